"""Hugging Face transformers models built offline from configs: tiny sizes, random weights.

Nothing is downloaded: each model is its class instantiated from a config written here.
Models that take keyword inputs (``labels=``, ``pixel_values=``) are called through
:class:`Keywords`, so ``check(model, *tensors)`` can pass them positionally; the stages
keep their own names under ``model.``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 100


class Keywords(nn.Module):
    """Calls ``model(**dict(zip(names, tensors)), **fixed)``; returns the loss or logits."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], **fixed: Any) -> None:
        super().__init__()
        self.model, self.names, self.fixed = model, names, fixed

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, tensors, strict=True)), **self.fixed)


def loss_of(output: Any) -> torch.Tensor:
    """The model's own loss if it computed one (labels given), else mean squared logits."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss  # type: ignore[no-any-return]
    logits = output.logits if hasattr(output, "logits") else output.last_hidden_state
    return logits.float().pow(2).mean()


def _t() -> Any:
    import transformers  # imported here: only the zoo needs it

    return transformers


def _ids(length: int = 8) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, length))


_ENC = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}


def bert(checkpointing: str | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    model = t.BertForMaskedLM(t.BertConfig(**_ENC))
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    return Keywords(model, ("input_ids", "labels")), (_ids(), _ids())


def distilbert() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.DistilBertConfig(
        dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=VOCAB, num_labels=3
    )
    model = t.DistilBertForSequenceClassification(config)
    return Keywords(model, ("input_ids", "labels")), (_ids(), torch.tensor([0, 2]))


def gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Keywords(t.GPT2LMHeadModel(config), ("input_ids", "labels")), (_ids(), _ids())


def llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.LlamaConfig(**_ENC, num_key_value_heads=1, bos_token_id=0, eos_token_id=0)
    return Keywords(t.LlamaForCausalLM(config), ("input_ids", "labels")), (_ids(), _ids())


_SEQ2SEQ = {"vocab_size": VOCAB, "pad_token_id": 0, "decoder_start_token_id": 0}


def t5() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.T5Config(
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        eos_token_id=1,
        **_SEQ2SEQ,
    )
    model = t.T5ForConditionalGeneration(config)
    return Keywords(model, ("input_ids", "labels")), (_ids(), _ids(6))


def switch() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.SwitchTransformersConfig(
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        num_experts=4,
        expert_capacity=8,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        eos_token_id=1,
        **_SEQ2SEQ,
    )
    model = t.SwitchTransformersForConditionalGeneration(config)
    return Keywords(model, ("input_ids", "labels")), (_ids(), _ids(6))


def bart() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.BartConfig(
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=2,
        forced_eos_token_id=2,
        **_SEQ2SEQ,
    )
    model = t.BartForConditionalGeneration(config)
    return Keywords(model, ("input_ids", "labels")), (_ids(), _ids(6))


def whisper() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        encoder_layers=2,
        decoder_layers=2,
        d_model=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    model = t.WhisperForConditionalGeneration(config)
    return Keywords(model, ("input_features", "labels")), (torch.randn(2, 8, 32), _ids(6))


def vit() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.ViTConfig(**{**_ENC, "vocab_size": None}, image_size=16, patch_size=4, num_labels=3)
    model = t.ViTForImageClassification(config)
    inputs = (torch.randn(2, 3, 16, 16), torch.tensor([0, 2]))
    return Keywords(model, ("pixel_values", "labels")), inputs


def clip() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    common = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
    }
    config = t.CLIPConfig(
        text_config={**common, "vocab_size": VOCAB, "max_position_embeddings": 16},
        vision_config={**common, "image_size": 16, "patch_size": 4},
        projection_dim=16,
    )
    model = t.CLIPModel(config)
    inputs = (_ids(), torch.randn(2, 3, 16, 16))
    return Keywords(model, ("input_ids", "pixel_values"), return_loss=True), inputs


def qwen2_moe() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.Qwen2MoeConfig(
        **_ENC,
        num_key_value_heads=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = t.Qwen2MoeForCausalLM(config)
    return Keywords(model, ("input_ids", "labels")), (_ids(), _ids())


def mixtral() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    t = _t()
    config = t.MixtralConfig(
        **_ENC,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Keywords(t.MixtralForCausalLM(config), ("input_ids", "labels")), (_ids(), _ids())


BUILDERS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "bert": bert,
    "bert-checkpoint-reentrant": lambda: bert("reentrant"),
    "bert-checkpoint": lambda: bert("non-reentrant"),
    "distilbert": distilbert,
    "gpt2": gpt2,
    "llama": llama,
    "t5-labels": t5,
    "switch-transformers-labels": switch,
    "bart-labels": bart,
    "whisper-labels": whisper,
    "vit": vit,
    "clip": clip,
    "qwen2-moe": qwen2_moe,
    "mixtral": mixtral,
}
