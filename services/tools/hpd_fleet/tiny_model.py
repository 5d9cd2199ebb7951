"""Writes a tiny Llama model folder that vLLM can serve with random weights, offline.

    python scripts/make_tiny_model.py OUT_DIR [--revision TAG]

The folder holds ``config.json`` (2 layers, hidden 128, 4 attention heads, 2 KV heads,
head_dim 48: the CPU attention backend refuses head_dim 16, and with a multiple of 32 on a
CPU with AMX it runs bf16 attention on AMX tiles, where the decode engine's worker died
with SIGILL at its first step on KV received over NIXL, in every one of three runs; 48
takes the vector kernel on every CPU, and the same transfers then all passed), a
byte-level BPE tokenizer
trained here in about a second (vocab 1024, so any text tokenizes), ``tokenizer_config.json``
naming ``PreTrainedTokenizerFast`` with a small chat template (vLLM answers 400 on
``/v1/chat/completions`` without one), and ``generation_config.json``.

Engines started with ``--load-format dummy`` draw the same weights from the same seed, so
a prefill/decode pair produces the tokens one instance computes alone. The ``tokenizers``
package is needed: run it with the engines' interpreter (it ships with vLLM).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 1024

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "prefill processes the prompt and decode generates tokens one at a time",
    "a key value cache holds attention state for every token of a sequence",
    "heterogeneous fleets mix accelerators of different kinds and sizes",
    "the scheduler chooses where prefill runs and where decode runs",
    "transfer the cache over the link or recompute it on the decode worker",
    "Hello, world! How are you today? 0123456789 + - * / = ( ) [ ] { } < > | _",
    "user assistant system role content message reply question answer",
]


def config(revision: str) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        # not read by the engine: lets two folders differ only in their revision
        "hpd_revision": revision,
    }


def train_tokenizer(out: Path) -> None:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    ap.add_argument("--revision", default="tiny-r1", help="tag stored in config.json")
    args = ap.parse_args(argv)
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config(args.revision), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}) + "\n"
    )
    train_tokenizer(out)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
