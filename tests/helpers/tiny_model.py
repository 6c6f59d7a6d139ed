"""Tiny random-weight models for fast tests: a real Hugging Face folder, made offline in about a second.

`make_tiny_model` writes config.json + model.safetensors (float32, through the transformers model class)
plus a real byte-level BPE tokenizer trained on the built-in text below (vocab ~400, specials
`<|endoftext|>` (eos/pad), `<|im_start|>`, `<|im_end|>`) with a ChatML chat template. Weights are drawn
with a larger scale than transformers' default, and norms and biases are random too, so logits are
spread out (no ties) and a loader that drops a bias or a norm weight changes the output.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TEXT = """\
Speculative decoding lets a small draft propose the next few tokens and the target model verify them
all in one forward pass. When the draft agrees with the target, several tokens come out of a single
step; when it disagrees, the first rejected token is replaced by one sampled from the adjusted
distribution, so the output is distributed exactly as the target's would have been.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness. The server batches requests continuously: requests join and leave between steps, and
every request keeps its own key-value cache, which can be rolled back when drafts are rejected.
User: Hello! Can you help me write a function? Assistant: Of course. What should the function do?
User: It should add two numbers and return the sum. Assistant: Here is a simple version in Python.
def add(a, b):
    return a + b

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

for i in range(10):
    print(i, fibonacci(i))

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "speculative decoding", "limit": 5}}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 3.14159 2.71828
Summaries are short; stories are long. Once upon a time there was a small model that wanted to
be fast. It guessed, and the big model checked; together they wrote the story twice as quickly.
"""


def train_tokenizer(vocab_size: int = 400):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the built-in text (specials get ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer)
    return tok


_CONFIGS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config"}


def make_tiny_model(
    path: str | Path,
    arch: str = "qwen2",
    vocab_size: int = 400,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    max_position_embeddings: int = 512,
    intermediate_size: int | None = None,
    init_std: float = 0.1,
) -> Path:
    """Write a tiny random-weight model folder at `path` and return it.

    `vocab_size` is the BPE training target; the model's vocab_size is set to the tokenizer's actual
    size (len(tokenizer)). arch: "qwen2" (q/k/v biases), "llama", or "qwen3" (q/k norms).
    Raises:
        ValueError: unknown arch, or hidden not divisible by heads.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    if arch not in _CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(_CONFIGS)}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_position_embeddings,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    config = getattr(transformers, _CONFIGS[arch])(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=init_std,
        dtype="float32",
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(init_std * noise)
    if tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    tc = path / "tokenizer_config.json"
    data = json.loads(tc.read_text())
    data["chat_template"] = CHAT_TEMPLATE  # also inline, as the converted models have it
    tc.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path
