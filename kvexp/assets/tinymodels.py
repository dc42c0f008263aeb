"""Tiny local models kvexp makes itself, so the default run and the tests download nothing.

The GGUF for llama.cpp: llama architecture, 2 layers, hidden 64, 2 heads of 32 (quantised KV types
need head_dim >= 32), F16 weights, a SentencePiece-style vocabulary of one character per token plus
the 256 byte-fallback tokens, and a ChatML template. Hidden dimension 0 is held constant through the
network (embeddings set it, no layer writes it) and the output rows of control and byte tokens weigh
it strongly negative, so EOS can never win: every request runs to exactly max_tokens, one printable
character per streamed chunk."""

from __future__ import annotations

import json
import os
import shutil
import string
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvexp.assets.evaltext import SHIPPED
from kvexp.core.paths import cache_dir

if TYPE_CHECKING:
    import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
TINY_GGUF_VERSION = 1  # bump when the file's content changes, so caches are rebuilt


def tiny_gguf_path() -> Path:
    return cache_dir() / "models" / f"tiny-llama-v{TINY_GGUF_VERSION}.gguf"


def ensure_tiny_gguf() -> Path:
    path = tiny_gguf_path()
    if not path.is_file():
        write_tiny_gguf(path)
    return path


def write_tiny_gguf(path: Path, n_layers: int = 2, n_embd: int = 64, n_head: int = 2,
                    n_head_kv: int = 2, n_ff: int = 128, n_ctx: int = 8192, seed: int = 0) -> Path:
    import gguf  # ~0.1 s to import: only when a model file is written
    import numpy as np  # ~0.1 s to import: only when a model file is written

    rng = np.random.default_rng(seed)
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens = list(specials)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    chars = ["\u2581"] + [c for c in string.ascii_letters + string.digits + string.punctuation]
    tokens += chars
    types += [gguf.TokenType.NORMAL] * len(chars)
    n_vocab = len(tokens)
    scores = [0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(chars))]
    head_dim = n_embd // n_head

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("kvexp-tiny-llama")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def t(*shape: int, scale: float = 0.02) -> "np.ndarray":
        return (rng.standard_normal(shape) * scale).astype(np.float16)

    emb = t(n_vocab, n_embd, scale=0.5)
    emb[:, 0] = 4.0  # the constant dimension
    w.add_tensor("token_embd.weight", emb)
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", t(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", t(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", t(n_head_kv * head_dim, n_embd))
        out = t(n_embd, n_embd)
        out[0, :] = 0  # no layer writes dimension 0
        w.add_tensor(f"blk.{i}.attn_output.weight", out)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(n_ff, n_embd))
        down = t(n_embd, n_ff)
        down[0, :] = 0
        w.add_tensor(f"blk.{i}.ffn_down.weight", down)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    head = t(n_vocab, n_embd, scale=1.0)
    head[:, 0] = 0.0
    head[: len(specials) + 256, 0] = -60.0  # control and byte tokens never win
    w.add_tensor("output.weight", head)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


# --- The tiny Hugging Face model for vLLM --------------------------------------------------------
# A random Qwen2 (hidden 128, 4 heads, 2 KV heads of 32, 2 layers, vocab 4096) with a byte-level BPE
# tokenizer trained here on seeded synthetic words, saved in bfloat16 (about 1.9 MB). transformers and
# torch live only in the vLLM venv, so the generator runs there as a subprocess. Every request runs to
# exactly max_tokens because kvexp's vLLM requests send ignore_eos and min_tokens.

TINY_HF_VERSION = 1  # bump when the generated files change, so caches are rebuilt
TINY_HF = {"seed": 0, "vocab": 4096, "hidden": 128, "heads": 4, "kv_heads": 2, "layers": 2,
           "intermediate": 256, "ctx": 4096}

_TINY_HF_SCRIPT = r'''
import json, random, sys
from pathlib import Path

out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

rng = random.Random(spec["seed"])
letters = "abcdefghijklmnopqrstuvwxyz"
def word():
    return "".join(rng.choice(letters) for _ in range(rng.randint(1, 9)))
lines = []
for _ in range(4000):
    words = [word() for _ in range(rng.randint(4, 16))]
    if rng.random() < 0.3:
        words.append(str(rng.randrange(10000)))
    lines.append(" ".join(words) + rng.choice([".", ",", "!", "?", ""]))

specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=spec["vocab"], special_tokens=specials, show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(lines, trainer=trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=spec["ctx"])
fast.chat_template = spec["chat_template"]

torch.manual_seed(spec["seed"])
config = Qwen2Config(
    vocab_size=tok.get_vocab_size(), hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
    num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
    num_key_value_heads=spec["kv_heads"], max_position_embeddings=spec["ctx"], tie_word_embeddings=True,
    initializer_range=spec.get("init", 0.02),
    bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
fast.save_pretrained(out)
'''


def tiny_hf_path() -> Path:
    return cache_dir() / "models" / f"tiny-qwen2-v{TINY_HF_VERSION}"


def ensure_tiny_hf(python: Path | str) -> Path:
    """The tiny HF model directory, made once with `python` (an interpreter with torch,
    transformers and tokenizers: the vLLM venv's) and cached; safe against concurrent makers."""
    return _ensure_hf(python, tiny_hf_path(), TINY_HF)


# The quality twin of the tiny HF model: the same recipe with weights drawn 5x wider (std 0.1), so
# logits spread over several nats and attention is sharp, and head_dim 64 like the quality GGUF.
TINY_HF_QUALITY_VERSION = 1
TINY_HF_QUALITY = {**TINY_HF, "seed": 1, "heads": 2, "kv_heads": 2, "init": 0.1}


def tiny_hf_quality_path() -> Path:
    return cache_dir() / "models" / f"tiny-qwen2-quality-v{TINY_HF_QUALITY_VERSION}"


def ensure_tiny_hf_quality(python: Path | str) -> Path:
    return _ensure_hf(python, tiny_hf_quality_path(), TINY_HF_QUALITY)


def _ensure_hf(python: Path | str, path: Path, model: dict) -> Path:
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.scratch", dir=path.parent))  # torch's temporary files
    try:
        spec = json.dumps({**model, "chat_template": CHATML})
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(scratch)}
        r = subprocess.run([str(python), "-c", _TINY_HF_SCRIPT, str(tmp), spec], env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if r.returncode != 0:
            last = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"making the tiny HF model with {python} failed (status {r.returncode}):\n{last}")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():  # not another maker winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return path


# --- A tiny GGUF for quality measurements ---------------------------------------------------------
# The tiny GGUF above is degenerate on purpose (one hidden dimension held fixed so EOS never wins),
# which makes its next-token distributions nearly one-hot: KL divergence and perplexity read
# nothing on it. This one has the same vocabulary and template but next-token distributions with a
# spread of a few nats: the held dimension carries each character's log-frequency in kvexp's
# evaluation text as a bias (control tokens and byte tokens other than the line break strongly
# negative, so EOS and invalid UTF-8 never win a greedy continuation), and sharp attention (large
# query/key weights) with value/output weights that write into the residual stream about as much as
# the embeddings do, so what the KV cache holds moves the output. head_dim 64 (quantised KV types
# need a multiple of 32), context 8192.

TINY_QUALITY_GGUF_VERSION = 1  # bump when the file's content changes, so caches are rebuilt


def tiny_quality_gguf_path() -> Path:
    return cache_dir() / "models" / f"tiny-llama-quality-v{TINY_QUALITY_GGUF_VERSION}.gguf"


def ensure_tiny_quality_gguf() -> Path:
    path = tiny_quality_gguf_path()
    if not path.is_file():
        write_tiny_quality_gguf(path)
    return path


def _char_log_freq(chars: list[str]) -> "np.ndarray":
    """Log-frequency of each vocabulary character in kvexp's evaluation text (spaces are U+2581),
    add-one smoothed, centred on the mean."""
    import numpy as np  # ~0.1 s to import: only when a model file is written

    text = SHIPPED.read_text(encoding="utf-8").replace(" ", "\u2581")
    counts = np.array([text.count("\n" if c == "<0x0A>" else c) + 1.0 for c in chars])
    logf = np.log(counts / counts.sum())
    return logf - logf.mean()


def write_tiny_quality_gguf(path: Path, n_layers: int = 2, n_embd: int = 128, n_head: int = 2,
                            n_ff: int = 256, n_ctx: int = 8192, seed: int = 1, qk_scale: float = 0.25,
                            vo_scale: float = 0.12, head_scale: float = 0.1,
                            bias_scale: float = 1.0) -> Path:
    """The quality GGUF. Its scales were chosen on kvexp's evaluation text with llama-perplexity
    (-c 512..4096): PPL about 37, mean KLD from the 16-bit KV cache about 6e-4 for q8_0 and 6e-2
    for q4_0, top-1 agreement about 98 % and 75 %."""
    import gguf  # ~0.1 s to import: only when a model file is written
    import numpy as np  # ~0.1 s to import: only when a model file is written

    rng = np.random.default_rng(seed)
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens = list(specials)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    chars = ["\u2581"] + [c for c in string.ascii_letters + string.digits + string.punctuation]
    tokens += chars
    types += [gguf.TokenType.NORMAL] * len(chars)
    n_vocab = len(tokens)
    n_fixed = len(specials) + 256
    scores = [0.0] * n_fixed + [-float(i) for i in range(len(chars))]
    head_dim = n_embd // n_head

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("kvexp-tiny-llama-quality")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def t(*shape: int, scale: float) -> "np.ndarray":
        return (rng.standard_normal(shape) * scale).astype(np.float16)

    emb = t(n_vocab, n_embd, scale=1.0)
    emb[:, 0] = 4.0  # the held dimension: a constant the output head turns into a per-token bias
    w.add_tensor("token_embd.weight", emb)
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", t(n_embd, n_embd, scale=qk_scale))
        w.add_tensor(f"blk.{i}.attn_k.weight", t(n_embd, n_embd, scale=qk_scale))
        w.add_tensor(f"blk.{i}.attn_v.weight", t(n_embd, n_embd, scale=vo_scale))
        out = t(n_embd, n_embd, scale=vo_scale)
        out[0, :] = 0  # no layer writes the held dimension
        w.add_tensor(f"blk.{i}.attn_output.weight", out)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(n_ff, n_embd, scale=0.05))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(n_ff, n_embd, scale=0.05))
        down = t(n_embd, n_ff, scale=0.05)
        down[0, :] = 0
        w.add_tensor(f"blk.{i}.ffn_down.weight", down)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    head = t(n_vocab, n_embd, scale=head_scale)
    newline = len(specials) + 0x0A  # the byte token the text's line breaks fall back to
    rows = [newline, *range(n_fixed, n_vocab)]
    head[:, 0] = -60.0  # control and other byte tokens never win
    head[rows, 0] = (bias_scale * _char_log_freq([tokens[r] for r in rows])).astype(np.float16)
    w.add_tensor("output.weight", head)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path
