"""Issue 24 moved recckpt/api/* into recckpt/train, recckpt/load, recckpt/tools and recckpt/state.
The old paths keep working for one version, with a DeprecationWarning, as the very same modules."""
import importlib
import subprocess
import sys
import warnings

import pytest

import recckpt
from recckpt.api import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_is_the_module_at_its_new_home(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(f"recckpt.api.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"recckpt\.api\.{old} moved to {MOVED[old]}"):
        mod = importlib.import_module(f"recckpt.api.{old}")
    assert mod is new


def test_from_import_of_an_old_module_and_its_names():
    """`from recckpt.api import saver` and `from recckpt.api.saver import Saver`, as user code wrote them."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    from recckpt.api.saver import Saver\nexcept DeprecationWarning as e:\n    print('W', e)\n"
            "warnings.simplefilter('ignore')\n"
            "from recckpt.api.saver import Saver\nfrom recckpt.api import reader, load_config\n"
            "import recckpt\nprint(Saver is recckpt.Saver, reader.open is recckpt.open,"
            " load_config.LoadConfig is recckpt.LoadConfig)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0].startswith("W recckpt.api.saver moved to recckpt.train.saver"), out
    assert out[1] == "True True True", out


def test_an_unknown_old_path_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("recckpt.api.no_such_module")


def test_every_public_name_resolves_without_the_old_paths():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in recckpt.__all__:
            assert getattr(recckpt, name) is not None, name
        assert all(not m.startswith("recckpt.api.") for m in recckpt._EXPORTS.values())


@pytest.mark.parametrize("folder", ["train", "load", "tools", "integrations"])
def test_each_layer_folder_says_what_it_owns_and_must_not_know(folder):
    doc = importlib.import_module(f"recckpt.{folder}").__doc__ or ""
    assert "import" in doc and len(doc.split()) > 30, doc
