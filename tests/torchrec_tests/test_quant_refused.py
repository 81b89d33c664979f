"""TorchRec's quantized inference EBC (torchrec.quant) was taken for a training EBC by its class name, and
a load of a training checkpoint into it failed with advice about the embedding dim ("shape (8,) vs
(16,)"), the wrong cause: its rows are int8 with a per-row scale and shift. It is now refused as what it
is, naming the module, and nothing is loaded. Run in a process of its own (the suite's never imports
torchrec)."""
from __future__ import annotations

from .harness import needs_torchrec, run_script

pytestmark = needs_torchrec

CHILD = r"""
import sys, warnings
warnings.filterwarnings("ignore")
import torch, recckpt
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
cfg = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=20, feature_names=["f"])]
class M(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
recckpt.Saver(M(EmbeddingBagCollection(tables=cfg)), output_dir=sys.argv[1]).save("c")
ebc = EmbeddingBagCollection(tables=cfg)
ebc.qconfig = torch.quantization.QConfig(activation=torch.quantization.PlaceholderObserver,
                                         weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
qm = M(QuantEBC.from_float(ebc))
before = {k: v.clone() for k, v in qm.state_dict().items()}
try:
    recckpt.Saver(qm, output_dir=sys.argv[1]).load()
    print("LOADED")
except Exception as e:
    print(type(e).__name__, str(e))
print("unchanged:", all(torch.equal(v, before[k]) for k, v in qm.state_dict().items()))
"""


def test_a_quantized_inference_collection_is_refused_as_such(tmp_path):
    p = run_script(code=CHILD, argv=[tmp_path / "out"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "LOADED" not in out and "unchanged: True" in out, out
    assert "InvalidArgumentError" in out and "quantized inference collection" in out and "'ebc." in out, out
