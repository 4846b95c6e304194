"""A head tied to the embeddings is stored once, in panels (worker/linears/tied_head.py): lookups give
the table's rows bit for bit, the model's logits stay as they were, one tensor serves both, and
every table it must not touch (untied, scaled, shared with a third module, not whole panels) stays."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE, tiny_config, tiny_model

from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.linears import panelled as panelled_linear
from inference_service.worker.linears import tied_head
from inference_service.worker.linears.panelled import PanelledLinear
from inference_service.worker.linears.tied_head import PanelledEmbedding


@pytest.fixture(scope="module")
def panel() -> cpu_kernels.PanelLinear:
    built = cpu_kernels.load_panel_linear()
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


def test_the_tied_table_is_held_once_in_panels_and_the_logits_stay(panel):
    assert VOCAB_SIZE % 32 == 0
    model = tiny_model(tiny_config("llama", tie_word_embeddings=True))
    table = model.model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[0, 1, 31, 32, 33, VOCAB_SIZE - 1, 7, 95]])
    with torch.no_grad():
        expected = model(ids).logits
        assert panelled_linear.install(model, panel) > 0
        assert tied_head.install(model, panel) == 1
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(embed, PanelledEmbedding) and isinstance(head, PanelledLinear)
        assert embed.weight_panels is head.weight_panels  # one tensor for both
        assert embed.num_embeddings == VOCAB_SIZE and embed.embedding_dim == table.shape[1]
        assert torch.equal(embed(ids), torch.nn.functional.embedding(ids, table))  # [1, 8, D], bit for bit
        assert torch.equal(embed(ids[0]), table[ids[0]])  # 1-d ids too
        assert torch.equal(embed.weight, table) and torch.equal(head.weight, table)
        logits = model(ids).logits
    assert (logits - expected).abs().max().item() < 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert tied_head.install(model, panel) == 0  # already done: nothing left to tie


class ScaledEmbedding(torch.nn.Embedding):
    """Like Gemma's: its own forward, which a lookup in panels would skip."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * 2.0


def untied(model: torch.nn.Module) -> None:
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)


def scaled(model: torch.nn.Module) -> None:
    old = model.model.embed_tokens
    new = ScaledEmbedding(old.num_embeddings, old.embedding_dim)
    new.weight = old.weight
    model.model.embed_tokens = new


def shared_with_a_third(model: torch.nn.Module) -> None:
    extra = torch.nn.Linear(model.config.hidden_size, VOCAB_SIZE, bias=False)
    extra.weight = model.model.embed_tokens.weight
    model.model.extra = extra


@pytest.mark.parametrize("change", [untied, scaled, shared_with_a_third, None])
def test_tables_it_must_not_touch_stay(panel, change):
    vocab = VOCAB_SIZE if change else VOCAB_SIZE + 8  # None: a vocabulary that is not whole panels
    model = tiny_model(tiny_config("llama", tie_word_embeddings=True, vocab_size=vocab))
    if change:
        change(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert tied_head.install(model, panel) == 0
    assert model.get_input_embeddings() is embed and model.get_output_embeddings() is head
