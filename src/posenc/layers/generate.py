"""Greedy generation of a causal :class:`~posenc.TransformerLM` (its ``generate`` calls :func:`greedy`):
eagerly over a preallocated :class:`~posenc.KVCache`, without a cache, or with the model's own
forward compiled on fixed-shape steps (gpt-fast's way, :mod:`posenc.layers.step`). Functions of the
model, which this module never imports."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..cache.kv_cache import KVCache
from .step import compiled_next_logits, layer_problems, next_logits

__all__ = ["greedy"]


def greedy(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool,
    eos_token: int | None,
    compiled: bool,
) -> Tensor:
    """``[B, T0 + new]`` after ``prompt [B, T0]`` (see ``TransformerLM.generate``), under no_grad,
    the model in eval mode for the call and its mode restored after."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    _check_prompt(prompt)
    if not model.causal:
        raise ValueError("generate needs a causal model (causal=True)")
    if compiled and not use_cache:
        raise ValueError("generate: compiled=True decodes over the cache; leave use_cache=True")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if compiled:
                return _greedy_compiled(model, prompt, max_new_tokens, eos_token)
            return _greedy(model, prompt, max_new_tokens, use_cache, eos_token)
    finally:
        model.train(was_training)


def _greedy_compiled(model: nn.Module, prompt: Tensor, max_new_tokens: int, eos_token: int | None) -> Tensor:
    if max_new_tokens == 0:
        return prompt
    cache = KVCache(max_length=prompt.shape[1] + max_new_tokens)
    token = model(prompt, cache=cache)[:, -1].argmax(dim=-1, keepdim=True)
    new = [token]
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    _check_fixed_shapes(model)
    with cache.fixed_shapes():
        for i in range(max_new_tokens - 1):
            if eos_token is not None:
                finished |= token[:, 0] == eos_token
                if bool(finished.all()):
                    break
            # the first step runs eagerly: every check of the plan raises as posenc's own error
            step = next_logits if i == 0 else compiled_next_logits
            token = step(model, token, cache).argmax(dim=-1, keepdim=True)
            new.append(token)
    return torch.cat([prompt, *new], dim=1)


def _check_fixed_shapes(model: nn.Module) -> None:
    """Refuse, with every reason, a model whose layers cannot decode in fixed shapes."""
    problems = [
        f"layer {i}: {problem}"
        for i, block in enumerate(model.blocks)
        for problem in layer_problems(block.attn, "slots")
    ]
    if problems:
        raise ValueError(
            "generate(compiled=True) decodes in fixed shapes, which this model's layers do not allow: "
            + "; ".join(problems)
            + "; pass compiled=False to decode it eagerly"
        )


def _greedy(
    model: nn.Module, prompt: Tensor, max_new_tokens: int, use_cache: bool, eos_token: int | None
) -> Tensor:
    tokens = prompt
    # Preallocated for the whole sequence: each step writes its keys in place (no concatenation).
    cache = KVCache(max_length=prompt.shape[1] + max_new_tokens) if use_cache else None
    step_input = prompt
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache) if use_cache else model(tokens)
        next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
        step_input = next_token
        if eos_token is not None:
            finished |= next_token[:, 0] == eos_token
            if bool(finished.all()):
                break
    return tokens


def _check_prompt(prompt: object) -> None:
    """``generate`` continues the last token of every row: ``prompt`` must be ``[B, T >= 1]`` ids."""
    ok = isinstance(prompt, Tensor) and prompt.dim() == 2 and prompt.shape[1] >= 1
    if ok and not prompt.dtype.is_floating_point and prompt.dtype != torch.bool:
        return  # the ids' range is checked with the tokens of the first forward
    if not isinstance(prompt, Tensor):
        got, hint = type(prompt).__name__, "pass torch.tensor([[ids...]])"
    elif prompt.dim() == 1:
        got, hint = f"shape {tuple(prompt.shape)}", "for one sequence pass prompt[None] ([1, T])"
    elif prompt.dim() == 2 and prompt.shape[1] == 0:
        got, hint = f"shape {tuple(prompt.shape)}", "give every row at least one token (a BOS id)"
    else:
        got, hint = f"shape {tuple(prompt.shape)} {prompt.dtype}", "pass integer token ids [B, T]"
    raise ValueError(f"generate: prompt must be integer token ids [B, T >= 1], got {got}; {hint}")
