"""Start-up recovery next to a writer that commits in place (object stores): the writer claims its target,
writes into it, commits (the manifest) and only then releases its claim. A recovery that saw the target
before the manifest and listed the claims after the release once deleted the committed checkpoint
(test_two_processes_one_s3_prefix, 1 run in 3). Here the commit is placed exactly in that window."""
import torch

from recckpt import Saver
from recckpt.format import catalog, names, recovery
from recckpt.storage import claims


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))


class CommitsBetweenListings:
    """The store, with a writer committing `c` (manifest back, claim released) just before recovery's
    second top-level listing."""

    def __init__(self, storage, manifest: bytes, claim: str):
        self.storage, self.manifest, self.claim, self.listings = storage, manifest, claim, 0

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def listdir(self, path):
        if path == "":
            self.listings += 1
            if self.listings == 2:
                self.storage.put_bytes(f"c/{names.MANIFEST}", self.manifest)
                self.storage.remove_file(self.claim)
        return self.storage.listdir(path)


def test_recovery_never_removes_a_target_committed_while_it_looked(tmp_path):
    saver = Saver(Model(), output_dir="memory://recovery-race")
    saver.save("c")
    store = saver.storage
    manifest = store.read_bytes(f"c/{names.MANIFEST}")
    store.remove_file(f"c/{names.MANIFEST}")                 # mid-save: files written, no manifest yet
    claim = names.owner_file("c", 0)
    store.put_bytes(claim, claims.encode(claims.body("c")))   # the writer's live claim
    racing = CommitsBetweenListings(store, manifest, claim)
    recovery.recover(racing)
    assert racing.listings >= 2, "recovery listed the directory once: the race window was not exercised"
    assert catalog.is_committed(store, "c"), "recovery removed a checkpoint committed while it looked"
    assert store.exists(f"c/{names.MANIFEST}")


def test_recovery_still_removes_an_abandoned_in_place_target(tmp_path):
    """The control: the same leftover with no claim and no commit is removed."""
    saver = Saver(Model(), output_dir="memory://recovery-abandoned")
    saver.save("c")
    store = saver.storage
    store.remove_file(f"c/{names.MANIFEST}")
    recovery.recover(store)
    assert not store.isdir("c")
