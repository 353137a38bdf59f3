"""Make the engine test's model pair locally: a tokenizer, a tiny Llama target and its draft.

Run with the engine environment's interpreter (``.venv-vllm-cpu``: torch,
transformers, tokenizers)::

    python tests/engine/tiny_models.py OUT_DIR

Nothing comes from a model hub. The tokenizer is a WordLevel vocabulary of
syllable words; the target is a 2-layer Llama with hidden size 128 and a large
initialiser range (peaked next-token distributions, so greedy decoding does not
wander uniformly); the draft is one layer of the target's weights with 5 %
noise and the target's second-layer output projections scaled by 0.1, so the
two agree on some tokens and not on others (acceptance neither 0 nor 1, and the
drafter's confidence tells them apart). Everything is seeded: the same files
every time. ``OUT_DIR/target`` and ``OUT_DIR/draft`` each hold a checkpoint and
the tokenizer; ``OUT_DIR/prompts.json`` the test's prompts.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

SEED = 0
VOCAB_WORDS = 1_600
PROMPTS = 24


def words(rng: random.Random) -> list[str]:
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    out: list[str] = []
    for n in itertools.count(1):
        for combo in itertools.product(syllables, repeat=n):
            out.append("".join(combo))
            if len(out) == VOCAB_WORDS:
                rng.shuffle(out)
                return out
    raise AssertionError


def make_tokenizer(vocab: list[str]):  # noqa: ANN201
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    ids = {w: i for i, w in enumerate(specials + vocab)}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )  # fmt: skip


def main(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(SEED)
    vocab = words(rng)
    tokenizer = make_tokenizer(vocab)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the second layer's outputs scaled down: one layer nearly suffices
        layer = target.model.layers[1]
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    draft = LlamaForCausalLM(draft_config).eval()
    state = {k: v for k, v in target.state_dict().items() if ".layers.1." not in k}
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        noisy = {
            k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) for k, v in state.items()
        }
    draft.load_state_dict(noisy)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(out / name, safe_serialization=True)
        tokenizer.save_pretrained(out / name)
    prompts = [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(4, 12))) for _ in range(PROMPTS)
    ]
    (out / "prompts.json").write_text(json.dumps(prompts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
