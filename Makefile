# Developer shortcuts. The README's two commands do not need make.
PY ?= .venv/bin/python

# Build into build/ and move the .so into place with an atomic rename, so a test run that has the old
# library mapped never sees a half-written file.
build:
	$(PY) setup.py -q build_ext --build-lib build/lib 2>&1 | grep -v -e "^running" -e "^copying" || true
	@so=$$(ls build/lib/recckpt/_C*.so) && cp $$so recckpt/.tmp_C.so && mv recckpt/.tmp_C.so recckpt/$$(basename $$so) && echo "built $$(basename $$so)"

test: build
	$(PY) -m pytest -q

.PHONY: build test
