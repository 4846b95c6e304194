"""A tiny Llama whose greedy continuation of a prompt is a text chosen by the test: real weights the
server loads like any model, no patching. Attention and MLP outputs are zeroed, so the last
position's logits depend on its own token only (a bigram model); each token of the script gets its
own embedding direction, and the output row of the token that must follow it points that way.

The script's tokens (and the prompt's last token, which starts it) must be distinct: a token that
appeared twice would need two successors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

STRENGTH = 4.0  # logit of the scripted successor: 4 * sqrt(hidden) = 32, far above the rest (about 0)


def write_scripted_model(folder: Path, tokenizer: Any, after_token: int, script: str, chat_template: str) -> list[int]:
    """Save the model, the tokenizer and `chat_template` in `folder`; greedy decoding after a prompt
    that ends with `after_token` writes `script`, then EOS. Returns the script's token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = tokenizer(script, add_special_tokens=False).input_ids
    chain = [after_token, *ids]
    assert len(set(chain)) == len(chain), f"the script's tokens repeat: {tokenizer.convert_ids_to_tokens(chain)}"
    assert tokenizer.decode(ids) == script
    hidden = 64
    assert len(chain) <= hidden, "one embedding direction per scripted token"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for direction, (token, successor) in enumerate(zip(chain, [*ids, tokenizer.eos_token_id], strict=True)):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(direction), hidden)
            model.lm_head.weight[successor] += STRENGTH * model.model.embed_tokens.weight[token]
    model.save_pretrained(folder)
    tokenizer = copy.deepcopy(tokenizer)  # the caller's stays as it was
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return ids
