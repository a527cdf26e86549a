"""Makes the tiny model the real-engine tests serve, from nothing but local
files: a byte-level BPE tokenizer and a 2-layer Llama trained briefly on the
Python standard library's sources.

Why trained and not random: a random-weight tiny Llama repeats one token
whatever its KV, so a request decoded on another request's KV would give the
same text and the tests could not see the corruption they exist for. A few
hundred steps of next-token training make greedy text depend on the prompt.

Deterministic for one machine and one interpreter (seeded torch, a sorted file
list, one thread), so a cached model and a fresh one agree; nothing is
downloaded. About 2 minutes on 2 free cores.

    python make_model.py OUT_DIR [--steps 500]

OUT_DIR gets config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json and generation_config.json, the
layout ``vllm serve OUT_DIR`` loads with no hub access.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

VOCAB = 2048
HIDDEN = 256
LAYERS = 2
HEADS = 4
SEQ = 128
BATCH = 8
MAX_POSITIONS = 512
# The corpus: these standard-library packages' .py files, in sorted order.
# A fixed list keeps the corpus the same size whatever else lib/ holds.
CORPUS_DIRS = ("asyncio", "email", "json", "http", "logging", "unittest", "xml", "concurrent")
CORPUS_BYTES = 6_000_000


def corpus_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for name in CORPUS_DIRS:
        files.extend(sorted((lib / name).rglob("*.py")))
    return [f for f in files if "test" not in f.parts]


def read_corpus() -> str:
    parts, size = [], 0
    for f in corpus_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= CORPUS_BYTES:
            break
    return "\n".join(parts)


def train_tokenizer(text: str, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chunks = [text[i : i + 100_000] for i in range(0, len(text), 100_000)]
    tok.train_from_iterator(chunks, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": MAX_POSITIONS,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}, indent=1)
    )
    return tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    t0 = time.monotonic()
    tmp = args.out.with_name(args.out.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)

    text = read_corpus()
    tok = train_tokenizer(text, tmp)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    print(f"make_model: corpus {len(text)} chars, {ids.numel()} tokens, "
          f"tokenizer in {time.monotonic() - t0:.1f} s", flush=True)

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN * 2,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, ids.numel() - SEQ, (BATCH,), generator=gen)
        batch = torch.stack([ids[s : s + SEQ] for s in starts.tolist()])
        # The model shifts labels itself: position i learns token i+1.
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"make_model: step {step} loss {out.loss.item():.3f} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)

    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=1)
    )
    if args.out.exists():
        import shutil

        shutil.rmtree(args.out)
    tmp.rename(args.out)
    print(f"make_model: {args.out} in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
