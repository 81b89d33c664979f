"""The TorchRec plugin without TorchRec: asking for the integration when torchrec is missing (or of an
untested version) names the extra and the install script, and models without TorchRec modules never
import it. Runs in subprocesses: this process never imports torchrec (tests/conftest.py checks that)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

from recckpt.errors import MissingDependencyError
from recckpt.state import plugins

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_missing_torchrec_names_the_extra_and_the_script():
    proc = _run("""
        import importlib.metadata as md
        real = md.version
        def version(name):
            if name == "torchrec":
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = version
        from recckpt.errors import MissingDependencyError
        try:
            import recckpt.integrations.torchrec
        except MissingDependencyError as e:
            print("ERR", e)
        else:
            print("imported")
    """)
    assert "ERR" in proc.stdout, proc.stdout + proc.stderr
    assert "torchrec" in proc.stdout and "recckpt[torchrec]" in proc.stdout
    assert "scripts/install_torchrec.sh" in proc.stdout
    assert issubclass(MissingDependencyError, ImportError)


def test_untested_version_is_refused_with_the_script():
    proc = _run("""
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "1.9.0" if name in ("fbgemm-gpu-cpu", "fbgemm-gpu") else real(name)
        try:
            import recckpt.integrations.torchrec
        except ImportError as e:
            print("ERR", type(e).__name__, e)
    """)
    assert "ERR MissingDependencyError" in proc.stdout, proc.stdout + proc.stderr
    assert "1.9.0" in proc.stdout and "install_torchrec.sh" in proc.stdout


def test_a_model_without_torchrec_modules_never_imports_torchrec(tmp_path):
    proc = _run(f"""
        import sys, torch, recckpt
        from recckpt.state.hashtable import HashTable
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.t = HashTable("t", 4)
                self.lin = torch.nn.Linear(2, 2)
        m = M()
        m.t.import_rows(torch.arange(5), {{"embedding": torch.ones(5, 4)}})
        s = recckpt.Saver(m, output_dir={str(tmp_path)!r})
        s.save("c1")
        s.load()
        print("torchrec" in sys.modules, any(k.startswith("recckpt.integrations") for k in sys.modules))
    """)
    assert proc.stdout.strip().splitlines()[-1] == "False False", proc.stdout + proc.stderr


def test_registry_ignores_lookalike_modules_while_torchrec_is_not_loaded():
    """A module class from a package named like the library: no adapter unless the library is imported
    (a model cannot hold a real TorchRec module otherwise)."""
    fake = type("EmbeddingBagCollection", (), {"__module__": "torchrec.modules.embedding_modules"})()
    model = types.SimpleNamespace(modules=lambda: [fake])
    saved = sys.modules.pop("torchrec", None)
    try:
        assert plugins.adapters_for(model) == []
        assert plugins.manifest_metadata(model) == {}
    finally:
        if saved is not None:
            sys.modules["torchrec"] = saved
    assert plugins.PLUGINS["torchrec."][1] == "recckpt.integrations.torchrec"
