"""A tiny random HF Llama with a small trained byte-level BPE tokenizer, saved to a folder: the model
that the ``--hf-model`` tests (the study, its report, the input checks) run the command line on."""

from __future__ import annotations

from pathlib import Path

#: The text the tokenizer is trained on (and the corpus the studies read): words, digits, code.
TEXT = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "The pass key is 12345. Remember it. 67890 is the pass key. What is the pass key? "
    "def parse_args(self, args=None, namespace=None): return 0123456789\n"
)


def byte_level_tokenizer(vocab_size: int, text: str = TEXT):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on ``text``, as HF's fast tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        [text] * 20,
        trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def save_tiny_llama(path: Path, context: int) -> Path:
    """A one-layer Llama (hidden 32, 2 heads, 1 KV head, ``context`` positions; seed 0) and a
    400-token tokenizer saved to ``path``."""
    import torch
    import transformers

    tokenizer = byte_level_tokenizer(400)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=420,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
