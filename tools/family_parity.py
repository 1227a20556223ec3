"""Print each model family's logits parity with transformers: max |Megatron - transformers| on
random token ids, fp32, at tensor parallel 1 and 2 (and expert parallel 2 for Qwen3-MoE).

The models are the test suite's (``tests/families.py``: each family's published config.json,
cut down), the comparison the one ``tests/megatron/test_families.py`` and
``tests/megatron/test_family_multirank.py`` assert (to 1e-5). Run from the repository root:

    PYTHONPATH=src:. python tools/family_parity.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def main() -> None:
    import transformers

    from rlcore_megatron.model.arch import read_hf_config
    from rlcore_megatron.model.gpt import build_gpt
    from rlcore_megatron.model.hf_weights import load_hf_weights
    from rlcore_megatron.parallel import init_megatron, shutdown_megatron
    from tests.families import FAMILIES, FamilyModels
    from tests.megatron import family_worker
    from tests.megatron.helpers import run_two_ranks

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = FamilyModels(root / "models")
        folders = {family: models.folder(family) for family in FAMILIES}
        expected = {}
        for family, folder in folders.items():
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            ids = family_worker.tokens(read_hf_config(folder).vocab_size)
            with torch.no_grad():
                expected[family] = hf(ids).logits
        init_megatron(1, 1234)
        tp1 = {}
        for family, folder in folders.items():
            arch = read_hf_config(folder)
            model = build_gpt(arch, "actor", torch.device("cpu")).eval()
            load_hf_weights(model, folder, arch, "actor")
            ids = family_worker.tokens(arch.vocab_size)
            with torch.no_grad():
                logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            tp1[family] = (logits[..., : arch.vocab_size] - expected[family]).abs().max().item()
        shutdown_megatron()
        out = root / "ranks"
        out.mkdir()
        run_two_ranks(family_worker.run, {f: str(p) for f, p in folders.items()}, str(out))
        print(f"{'family':<10} {'TP=1':>10} {'TP=2':>10} {'EP=2':>10}  (max abs logits diff)")
        for family in FAMILIES:
            row = [f"{tp1[family]:10.2e}"]
            for layout in ("tp2", "ep2"):
                diffs = []
                for rank in range(2):
                    found = torch.load(out / f"{layout}.rank{rank}.pt")
                    if family in found:
                        diffs.append((found[family]["logits"] - expected[family]).abs().max())
                row.append(f"{max(diffs).item():10.2e}" if diffs else f"{'-':>10}")
            print(f"{family:<10} {' '.join(row)}")


if __name__ == "__main__":
    main()
