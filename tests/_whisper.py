"""What the Whisper tests share (tests/hf/test_whisper.py on a tiny random model, tests/test_real_whisper.py
on whisper-base): a plain greedy loop with HF's cache, and a spy that counts which posenc backend served
each of Whisper's three kinds of attention."""

from __future__ import annotations

import torch

#: Whisper's three attentions, by the HF module that runs them.
ROLES = ("encoder self", "decoder self", "cross")


def greedy(
    model, encoder_out: torch.Tensor, prompt: list[int], steps: int, never: tuple[int, ...] = ()
) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens after ``prompt`` (never stopping at the end token; the tokens ``never``
    are never chosen), decoding one token a step with HF's ``EncoderDecoderCache``; returns them and
    the logits that chose them ``[steps, V]``."""
    from transformers import DynamicCache, EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    chose: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(steps):
            out = model(encoder_outputs=(encoder_out,), decoder_input_ids=ids, cache=cache, use_cache=True)
            logits = out.logits[0, -1]
            chose.append(logits)
            allowed = logits.clone()
            allowed[list(never)] = float("-inf")
            tokens.append(int(allowed.argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(chose)


class RoleSpy:
    """Counts ``(role, backend)`` of every HF attention call posenc serves in ``model`` (a Whisper):
    posenc's bridge notes the backend of each call it serves (plain decode steps included)."""

    def __init__(self, monkeypatch, model) -> None:
        import posenc.hf._attention as bridge

        self.counts: dict[tuple[str, str], int] = {}
        self.role = "none"
        original = bridge.note_backend

        def note(name: str) -> None:
            self.counts[(self.role, name)] = self.counts.get((self.role, name), 0) + 1
            original(name)

        monkeypatch.setattr(bridge, "note_backend", note)
        decoder = model.model.decoder
        modules = [(layer.self_attn, "encoder self") for layer in model.model.encoder.layers]
        modules += [(layer.self_attn, "decoder self") for layer in decoder.layers]
        modules += [(layer.encoder_attn, "cross") for layer in decoder.layers]
        self._handles = [
            module.register_forward_pre_hook(lambda *args, role=role: setattr(self, "role", role))
            for module, role in modules
        ]

    def served(self, role: str) -> int:
        """How many calls of ``role`` posenc served."""
        return sum(count for (seen, _), count in self.counts.items() if seen == role)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
