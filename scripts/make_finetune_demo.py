"""Make the inputs of configs/finetune-lora.yaml and configs/finetune-qlora.yaml, with no download:

    python scripts/make_finetune_demo.py [--out runs/finetune-demo] [--records 4000]

  OUT/hf-base/     a small Llama-family model (RoPE, RMSNorm, SwiGLU, GQA, untied head; byte vocabulary) saved
                   in Hugging Face format by dist_llm.convert.save_hf, from a seeded random init: the stand-in for a
                   pretrained model someone would download
  OUT/train.jsonl  prompt/completion records of small sums ("Q: 12+7= A:" -> " 19"), generated from a seed

Then `dist-llm train --config configs/finetune-lora.yaml` fine-tunes it (its loss falls within a few hundred
steps), and `dist-llm convert --to-hf runs/finetune-lora --out DIR` exports the merged result.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make(out: Path, records: int, seed: int = 0) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT))
    import torch

    from dist_llm.config import ModelConfig
    from dist_llm.convert import save_hf
    from dist_llm.model import GPT

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, vocab_size=256, block_size=128, pos_emb="rope",
                      norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
    base = out / "hf-base"
    if not (base / "config.json").is_file():
        save_hf(GPT(cfg), base)
    rng = random.Random(seed)
    lines = []
    for _ in range(records):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(json.dumps({"prompt": f"Q: {a}+{b}= A:", "completion": f" {a + b}"}))
    data = out / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return base, data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "finetune-demo")
    p.add_argument("--records", type=int, default=4000)
    args = p.parse_args()
    base, data = make(args.out, args.records)
    print(f"{base}\n{data}")


if __name__ == "__main__":
    main()
