"""Build a corpus of modern architectures as ONNX files with random weights.

Usage: python bench/modern_corpus.py [--out DIR] [--venv DIR] [--only NAME[,NAME]] [--force] [--list]

Why: the nine light models shipped with onnx are small, old CNNs. The fidelity and
wall-clock benchmarks also need what people deploy today: transformer encoders and
decoders, encoder halves of encoder-decoder models, ViTs, hierarchical and mobile
convolutional nets, audio encoders, and INT8 models made by onnxruntime's own
quantization tools. Weights do not change which layers a model has nor (barring
denormals) how long they take, so every model is built from its config class with
the published hyper-parameters written out below and random weights: nothing is
downloaded at run time (no ``from_pretrained``, no hub).

What it builds: one folder per model, ``OUT/<name>/model.onnx`` (a model-zoo layout),
batch 1 and static shapes (text: 128 tokens, int64 ``input_ids`` and, where the model
takes one, ``attention_mask``; vision: 1x3x224x224; audio: 1 s of 16 kHz samples, or
the 80x3000 log-mel frames of Whisper, or the 1024x128 frames of AST), exported with
torch's TorchScript exporter at opset 17 (the dynamo exporter needs onnxscript and
rewrites more of the graph). The quantized variants are ``resnet50-int8-qdq``
(``quantize_static``, QDQ, 8 random calibration samples) and ``distilbert-int8-dynamic``
(``quantize_dynamic``). ``--list`` prints the names; files already there are skipped
unless ``--force``.

torch and transformers are never dependencies of dlbricks: the script installs them
(pinned) with onnx and onnxruntime into a virtual environment of its own (default
``~/.cache/dlbricks-bench/venv``, made with ``python -m venv`` when missing) and runs
its export step there by re-executing itself with ``--_export``. Nothing is written
inside the repository.

Denormals: random weights must not time differently from trained ones, and subnormal
float32 values make CPU kernels slow. So every normalisation layer gets weight 1,
bias 0, and BatchNorm running statistics 0 and 1; the mobile nets, whose convs
transformers initialises too small for identity BatchNorms, get variance-preserving
conv weights; after export every float32 initializer and Constant is scanned and any
subnormal value flushed to zero; and the fraction of subnormal values among the
activations of one forward pass in torch, with the smallest RMS of any layer's output,
is recorded.

Checks: each model is loaded and run once by onnxruntime (CPU, 1 thread) on random
inputs; for exported models the output is compared with torch's on the same inputs.
``OUT/manifest.json`` records per model: family (text/vision/audio), file size, inputs
(names, shapes, types), session load time and the one-run latency. A model that fails
is reported on stderr in one line and the script goes on; the exit status is non-zero
only when nothing could be built. The last line of stdout is one JSON object:
{"out", "built", "skipped", "failed", "seconds", ...}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SCHEMA_VERSION = 1
# Pinned so that a rebuilt corpus has the same graphs: the graph is the code of
# transformers' modeling files as traced by this torch.
TORCH_VERSION = "2.13.0"
TRANSFORMERS_VERSION = "5.24.0"
VENV_PACKAGES = [f"torch=={TORCH_VERSION}", f"transformers=={TRANSFORMERS_VERSION}",
                 "onnx", "onnxruntime", "numpy"]
OPSET = 17
ROOT = Path.home() / ".cache" / "dlbricks-bench"
SEQ = 128
IMAGE = 224
# Padding at the end of the traced attention mask: a mask of all ones lets
# transformers skip building the mask, and the trace would then drop the input.
MASK_PAD = 8
FLT_MIN = 1.1754943508222875e-38  # smallest normal float32
TWO_GB = 2**31


# ---------------------------------------------------------------------------
# Inputs: (name, shape, dtype, high). For int64 ``high`` bounds the random ids
# (the vocabulary); for float inputs it is the scale of the normal noise.

def text_inputs(vocab: int, mask: bool = True) -> tuple:
    ids = ("input_ids", (1, SEQ), "int64", vocab)
    return (ids, ("attention_mask", (1, SEQ), "int64", 2)) if mask else (ids,)


IMAGE_INPUTS = (("pixel_values", (1, 3, IMAGE, IMAGE), "float32", 1.0),)
WAVE_INPUTS = (("input_values", (1, 16000), "float32", 0.1),)
WHISPER_INPUTS = (("input_features", (1, 80, 3000), "float32", 1.0),)
AST_INPUTS = (("input_values", (1, 1024, 128), "float32", 1.0),)


# ---------------------------------------------------------------------------
# Builders: each returns a torch module built from a config with the published
# hyper-parameters of the named checkpoint. transformers is imported inside them
# so that ``--list`` and the outer process need neither it nor torch.
# Attention is "eager": the explicit MatMul/Softmax/MatMul form that exported
# model zoos have and that onnxruntime's transformer fusions look for.

EAGER = {"attn_implementation": "eager"}


def bert_base():
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                                num_attention_heads=12, intermediate_size=3072,
                                max_position_embeddings=512, **EAGER))


def minilm_l6():  # sentence-transformers/all-MiniLM-L6-v2
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                                num_attention_heads=12, intermediate_size=1536,
                                max_position_embeddings=512, **EAGER))


def roberta_base():
    from transformers import RobertaConfig, RobertaModel
    return RobertaModel(RobertaConfig(vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                                      num_attention_heads=12, intermediate_size=3072,
                                      max_position_embeddings=514, type_vocab_size=1,
                                      pad_token_id=1, layer_norm_eps=1e-5, **EAGER))


def distilbert_base():
    from transformers import DistilBertConfig, DistilBertModel
    return DistilBertModel(DistilBertConfig(vocab_size=30522, dim=768, n_layers=6, n_heads=12,
                                            hidden_dim=3072, max_position_embeddings=512, **EAGER))


def albert_base_v2():
    from transformers import AlbertConfig, AlbertModel
    return AlbertModel(AlbertConfig(vocab_size=30000, embedding_size=128, hidden_size=768,
                                    num_hidden_layers=12, num_attention_heads=12,
                                    intermediate_size=3072, hidden_act="gelu_new",
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                    **EAGER))


def electra_small():  # google/electra-small-discriminator
    from transformers import ElectraConfig, ElectraModel
    return ElectraModel(ElectraConfig(vocab_size=30522, embedding_size=128, hidden_size=256,
                                      num_hidden_layers=12, num_attention_heads=4,
                                      intermediate_size=1024, **EAGER))


def mpnet_base():
    from transformers import MPNetConfig, MPNetModel
    return MPNetModel(MPNetConfig(vocab_size=30527, hidden_size=768, num_hidden_layers=12,
                                  num_attention_heads=12, intermediate_size=3072,
                                  max_position_embeddings=514, relative_attention_num_buckets=32,
                                  **EAGER))


def deberta_v3_small():
    from transformers import DebertaV2Config, DebertaV2Model
    return DebertaV2Model(DebertaV2Config(
        vocab_size=128100, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512, type_vocab_size=0,
        relative_attention=True, position_buckets=256, norm_rel_ebd="layer_norm",
        share_att_key=True, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
        position_biased_input=False, layer_norm_eps=1e-7, **EAGER))


def gpt2_small():
    from transformers import GPT2Config, GPT2Model
    return GPT2Model(GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                                n_head=12, use_cache=False, **EAGER))


def opt_125m():
    from transformers import OPTConfig, OPTModel
    return OPTModel(OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12,
                              num_attention_heads=12, ffn_dim=3072, max_position_embeddings=2048,
                              word_embed_proj_dim=768, do_layer_norm_before=True,
                              use_cache=False, **EAGER))


def smollm_135m():  # HuggingFaceTB/SmolLM-135M: a Llama with grouped-query attention
    from transformers import LlamaConfig, LlamaModel
    return LlamaModel(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                  num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, max_position_embeddings=2048,
                                  rms_norm_eps=1e-5, rope_theta=10000.0,
                                  tie_word_embeddings=True, use_cache=False, **EAGER))


def pythia_70m():  # EleutherAI/pythia-70m: GPT-NeoX, partial rotary, parallel residual
    from transformers import GPTNeoXConfig, GPTNeoXModel
    return GPTNeoXModel(GPTNeoXConfig(vocab_size=50304, hidden_size=512, num_hidden_layers=6,
                                      num_attention_heads=8, intermediate_size=2048,
                                      rotary_pct=0.25, rotary_emb_base=10000,
                                      max_position_embeddings=2048, use_parallel_residual=True,
                                      use_cache=False, **EAGER))


def t5_base_encoder():
    from transformers import T5Config, T5EncoderModel
    return T5EncoderModel(T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072,
                                   num_layers=12, num_heads=12, relative_attention_num_buckets=32,
                                   feed_forward_proj="relu", **EAGER))


def flan_t5_small_encoder():  # T5 v1.1 layout: gated GELU feed-forward
    from transformers import T5Config, T5EncoderModel
    return T5EncoderModel(T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=1024,
                                   num_layers=8, num_heads=6, relative_attention_num_buckets=32,
                                   feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                   **EAGER))


def bart_base_encoder():
    from transformers import BartConfig, BartModel
    return BartModel(BartConfig(vocab_size=50265, d_model=768, encoder_layers=6,
                                decoder_layers=6, encoder_attention_heads=12,
                                decoder_attention_heads=12, encoder_ffn_dim=3072,
                                decoder_ffn_dim=3072, max_position_embeddings=1024,
                                **EAGER)).get_encoder()


def vit_base(patch: int):
    def build():
        from transformers import ViTConfig, ViTForImageClassification
        return ViTForImageClassification(ViTConfig(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072, image_size=IMAGE, patch_size=patch, num_labels=1000,
            **EAGER))
    return build


def deit_small():
    from transformers import DeiTConfig, DeiTForImageClassification
    return DeiTForImageClassification(DeiTConfig(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
        image_size=IMAGE, patch_size=16, num_labels=1000, **EAGER))


def clip_vit_b32_vision():  # openai/clip-vit-base-patch32, image tower with projection
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    return CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=768, intermediate_size=3072, projection_dim=512, num_hidden_layers=12,
        num_attention_heads=12, image_size=IMAGE, patch_size=32, hidden_act="quick_gelu",
        **EAGER))


def dinov2_small():
    # The published position table is for 518x518 (37x37 patches); at 224 the model
    # interpolates it, as it does when people run it at 224.
    from transformers import Dinov2Config, Dinov2Model
    return Dinov2Model(Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                    mlp_ratio=4, image_size=518, patch_size=14,
                                    layerscale_value=1.0, **EAGER))


def swin_tiny():
    from transformers import SwinConfig, SwinForImageClassification
    return SwinForImageClassification(SwinConfig(
        image_size=IMAGE, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24], window_size=7, mlp_ratio=4.0, num_labels=1000, **EAGER))


def convnext_tiny():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    return ConvNextForImageClassification(ConvNextConfig(
        hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3], patch_size=4,
        layer_scale_init_value=1e-6, num_labels=1000))


def resnet(depths: list[int], hidden: list[int], layer_type: str):
    def build():
        from transformers import ResNetConfig, ResNetForImageClassification
        return ResNetForImageClassification(ResNetConfig(
            embedding_size=64, hidden_sizes=hidden, depths=depths, layer_type=layer_type,
            num_labels=1000))
    return build


def _kaiming_convs(model):
    """Variance-preserving conv weights. transformers initialises these nets' convs
    with normal(0, 0.02); behind BatchNorms that are identities, each depthwise conv
    then shrinks the activations ~20x, down to 1e-21 at the output, on the way to
    denormals. A trained net's BatchNorms keep them near unit scale instead."""
    import torch
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
    return model


def efficientnet_b0():
    from transformers import EfficientNetConfig, EfficientNetForImageClassification
    return _kaiming_convs(EfficientNetForImageClassification(EfficientNetConfig(
        image_size=IMAGE, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280,
        dropout_rate=0.2, num_labels=1000)))


def mobilenet_v2():  # google/mobilenet_v2_1.0_224 (1001 classes: background + ImageNet)
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification
    return _kaiming_convs(MobileNetV2ForImageClassification(MobileNetV2Config(
        image_size=IMAGE, depth_multiplier=1.0, num_labels=1001)))


def regnet_y_040():
    from transformers import RegNetConfig, RegNetForImageClassification
    return RegNetForImageClassification(RegNetConfig(
        embedding_size=32, hidden_sizes=[128, 192, 512, 1088], depths=[2, 6, 12, 2],
        groups_width=64, layer_type="y", num_labels=1000))


def segformer_b0():  # nvidia/mit-b0: the hierarchical Mix Transformer encoder
    from transformers import SegformerConfig, SegformerForImageClassification
    return SegformerForImageClassification(SegformerConfig(
        hidden_sizes=[32, 64, 160, 256], depths=[2, 2, 2, 2], num_attention_heads=[1, 2, 5, 8],
        sr_ratios=[8, 4, 2, 1], num_labels=1000))


def whisper_encoder(d_model: int, layers: int, heads: int):
    def build():
        from transformers import WhisperConfig, WhisperModel
        return WhisperModel(WhisperConfig(
            vocab_size=51865, num_mel_bins=80, d_model=d_model, encoder_layers=layers,
            decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
            encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model,
            max_source_positions=1500, max_target_positions=448, **EAGER)).get_encoder()
    return build


def wav2vec2_base():
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    return Wav2Vec2Model(Wav2Vec2Config(hidden_size=768, num_hidden_layers=12,
                                        num_attention_heads=12, intermediate_size=3072,
                                        feat_extract_norm="group", do_stable_layer_norm=False,
                                        **EAGER))


def hubert_base():
    from transformers import HubertConfig, HubertModel
    return HubertModel(HubertConfig(hidden_size=768, num_hidden_layers=12,
                                    num_attention_heads=12, intermediate_size=3072,
                                    feat_extract_norm="group", do_stable_layer_norm=False,
                                    **EAGER))


def wavlm_base():  # gated relative position bias in every layer
    from transformers import WavLMConfig, WavLMModel
    return WavLMModel(WavLMConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                  intermediate_size=3072, feat_extract_norm="group",
                                  do_stable_layer_norm=False, num_buckets=320,
                                  max_bucket_distance=800, **EAGER))


def ast_base():  # MIT/ast-finetuned-audioset-10-10-0.4593
    from transformers import ASTConfig, ASTForAudioClassification
    return ASTForAudioClassification(ASTConfig(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        patch_size=16, frequency_stride=10, time_stride=10, max_length=1024, num_mel_bins=128,
        num_labels=527, **EAGER))


# ---------------------------------------------------------------------------
# Random inputs, and the quantizers (they take the float model's path and write the
# quantized one).

def _random_feeds(inputs: tuple, seed: int) -> dict:
    """Random values for ``inputs``; an attention mask masks its last MASK_PAD tokens."""
    import numpy as np
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, shape, dtype, high in inputs:
        if dtype == "int64" and name == "attention_mask":
            mask = np.ones(shape, np.int64)
            mask[..., shape[-1] - MASK_PAD:] = 0
            feeds[name] = mask
        elif dtype == "int64":
            feeds[name] = rng.integers(0, high, size=shape, dtype=np.int64)
        else:
            feeds[name] = (rng.standard_normal(shape) * high).astype(np.float32)
    return feeds


def quantize_static_qdq(src: Path, dst: Path, entry: Entry) -> dict:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Calibration(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter([_random_feeds(entry.inputs, 100 + i) for i in range(8)])

        def get_next(self):
            return next(self.samples, None)

    pre = dst.with_name("pre.onnx")
    try:
        quant_pre_process(str(src), str(pre))
        # U8 activations with S8 per-channel weights: the combination onnxruntime's
        # quantization guide recommends for CNNs on x86.
        quantize_static(str(pre), str(dst), Calibration(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        per_channel=True)
    finally:
        pre.unlink(missing_ok=True)
    return {"quantization": "static QDQ, U8 activations, S8 per-channel weights, "
                            "8 random calibration samples, MinMax"}


def quantize_dynamic_int8(src: Path, dst: Path, entry: Entry) -> dict:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = dst.with_name("pre.onnx")
    try:
        quant_pre_process(str(src), str(pre))
        quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8)
    finally:
        pre.unlink(missing_ok=True)
    return {"quantization": "dynamic, S8 weights"}


# ---------------------------------------------------------------------------
# The corpus.

@dataclass(frozen=True)
class Entry:
    name: str
    family: str                  # text / vision / audio
    build: Callable[..., Any]    # a torch-module builder, or a quantizer when ``base`` is set
    inputs: tuple
    base: str | None = None      # the float model a quantized entry is made from


MODELS: list[Entry] = [
    # transformer encoders
    Entry("bert-base", "text", bert_base, text_inputs(30522)),
    Entry("roberta-base", "text", roberta_base, text_inputs(50265)),
    Entry("distilbert-base", "text", distilbert_base, text_inputs(30522)),
    Entry("albert-base-v2", "text", albert_base_v2, text_inputs(30000)),
    Entry("electra-small", "text", electra_small, text_inputs(30522)),
    Entry("minilm-l6", "text", minilm_l6, text_inputs(30522)),
    Entry("mpnet-base", "text", mpnet_base, text_inputs(30527)),
    Entry("deberta-v3-small", "text", deberta_v3_small, text_inputs(128100)),
    # decoders (base models: no LM head, no KV cache: one full-sequence pass)
    Entry("gpt2", "text", gpt2_small, text_inputs(50257)),
    Entry("opt-125m", "text", opt_125m, text_inputs(50272)),
    Entry("smollm-135m", "text", smollm_135m, text_inputs(49152)),
    Entry("pythia-70m", "text", pythia_70m, text_inputs(50304)),
    # encoders of encoder-decoder models
    Entry("t5-base-encoder", "text", t5_base_encoder, text_inputs(32128)),
    Entry("flan-t5-small-encoder", "text", flan_t5_small_encoder, text_inputs(32128)),
    Entry("bart-base-encoder", "text", bart_base_encoder, text_inputs(50265)),
    # vision transformers
    Entry("vit-base-patch16-224", "vision", vit_base(16), IMAGE_INPUTS),
    Entry("vit-base-patch32-224", "vision", vit_base(32), IMAGE_INPUTS),
    Entry("deit-small-patch16-224", "vision", deit_small, IMAGE_INPUTS),
    Entry("clip-vit-base-patch32-vision", "vision", clip_vit_b32_vision, IMAGE_INPUTS),
    Entry("dinov2-small", "vision", dinov2_small, IMAGE_INPUTS),
    # hierarchical and convolutional vision
    Entry("swin-tiny-patch4-window7-224", "vision", swin_tiny, IMAGE_INPUTS),
    Entry("segformer-mit-b0", "vision", segformer_b0, IMAGE_INPUTS),
    Entry("convnext-tiny-224", "vision", convnext_tiny, IMAGE_INPUTS),
    Entry("resnet-50", "vision",
          resnet([3, 4, 6, 3], [256, 512, 1024, 2048], "bottleneck"), IMAGE_INPUTS),
    Entry("resnet-18", "vision", resnet([2, 2, 2, 2], [64, 128, 256, 512], "basic"), IMAGE_INPUTS),
    Entry("efficientnet-b0", "vision", efficientnet_b0, IMAGE_INPUTS),
    Entry("mobilenet-v2-1.0-224", "vision", mobilenet_v2, IMAGE_INPUTS),
    Entry("regnet-y-040", "vision", regnet_y_040, IMAGE_INPUTS),
    # audio encoders
    Entry("whisper-base-encoder", "audio", whisper_encoder(512, 6, 8), WHISPER_INPUTS),
    Entry("whisper-tiny-encoder", "audio", whisper_encoder(384, 4, 6), WHISPER_INPUTS),
    Entry("wav2vec2-base", "audio", wav2vec2_base, WAVE_INPUTS),
    Entry("hubert-base", "audio", hubert_base, WAVE_INPUTS),
    Entry("wavlm-base", "audio", wavlm_base, WAVE_INPUTS),
    Entry("ast-audioset", "audio", ast_base, AST_INPUTS),
    # INT8, made by onnxruntime's quantization tools from the float models above
    Entry("resnet50-int8-qdq", "vision", quantize_static_qdq, IMAGE_INPUTS, base="resnet-50"),
    Entry("distilbert-int8-dynamic", "text", quantize_dynamic_int8, text_inputs(30522),
          base="distilbert-base"),
]
BY_NAME = {e.name: e for e in MODELS}


# ---------------------------------------------------------------------------
# Outer process: the virtual environment, then re-execution inside it.

def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path) -> Path:
    """Create ``venv`` if missing and install the pinned packages unless present."""
    py = venv_python(venv)
    if not py.exists():
        print(f"modern_corpus: creating {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    check = ("import torch, transformers, onnx, onnxruntime, numpy; "
             f"assert torch.__version__.split('+')[0] == {TORCH_VERSION!r}; "
             f"assert transformers.__version__ == {TRANSFORMERS_VERSION!r}")
    if subprocess.run([str(py), "-c", check], capture_output=True).returncode != 0:
        print(f"modern_corpus: installing {' '.join(VENV_PACKAGES)} into {venv}", file=sys.stderr)
        # pip's progress goes to stderr: stdout keeps only the final JSON line.
        subprocess.run([str(py), "-m", "pip", "install", "-q", *VENV_PACKAGES],
                       check=True, stdout=sys.stderr)
    return py


# ---------------------------------------------------------------------------
# Export step (inside the venv).

def _tame_norms(model) -> None:
    """Normalisation layers as a trained model has them, far from denormal ranges."""
    import torch
    with torch.no_grad():
        for module in model.modules():
            kind = type(module).__name__
            if isinstance(module, torch.nn.modules.batchnorm._NormBase):
                if module.running_mean is not None:
                    module.running_mean.zero_()
                    module.running_var.fill_(1.0)
            elif not (isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm))
                      or kind.endswith(("LayerNorm", "RMSNorm"))):
                continue
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 1:
                weight.fill_(1.0)
            if isinstance(bias, torch.Tensor) and bias.dim() == 1:
                bias.zero_()


def _activation_scan(model, args) -> tuple[Any, dict]:
    """Run ``model(*args)``; return its output, the fraction of subnormal float32 values
    among the outputs of all leaf modules and the smallest nonzero RMS of one of them
    (how far the activations are from the denormal range)."""
    import torch
    counts = [0, 0]
    rms = [float("inf")]

    def hook(_module, _inputs, output):
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                a = t.abs()
                counts[0] += int(((a > 0) & (a < FLT_MIN)).sum())
                counts[1] += t.numel()
                r = float(t.double().pow(2).mean().sqrt())
                if r > 0:
                    rms[0] = min(rms[0], r)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if not any(True for _ in m.children())]
    try:
        with torch.no_grad():
            out = model(*args)
    finally:
        for h in handles:
            h.remove()
    return out, {"subnormal_activation_fraction": counts[0] / max(counts[1], 1),
                 "activation_rms_min": rms[0] if rms[0] < float("inf") else None}


def _flush_subnormals(path: Path) -> int:
    """Zero every subnormal float32 in the initializers and Constants; return how many."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        tensors += [a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR]
    flushed = 0
    for t in tensors:
        if t.data_type != onnx.TensorProto.FLOAT:
            continue
        a = numpy_helper.to_array(t)
        bad = (a != 0) & (np.abs(a) < FLT_MIN)
        n = int(bad.sum())
        if n:
            t.CopyFrom(numpy_helper.from_array(np.where(bad, np.float32(0), a), t.name))
            flushed += n
    if flushed:
        big = model.ByteSize() > TWO_GB - 2**24
        onnx.save(model, str(path), save_as_external_data=big,
                  location=path.name + ".data" if big else None)
    return flushed


def export_torch(entry: Entry, path: Path) -> dict:
    """Export ``entry`` to ``path``; return what the manifest records about the export."""
    import numpy as np
    import torch

    torch.manual_seed(0)
    model = entry.build().eval()
    _tame_norms(model)
    names = [spec[0] for spec in entry.inputs]

    class FirstOutput(torch.nn.Module):
        """Keyword inputs and one tensor out: transformers' forward signatures take
        more positional arguments than the trace passes, and return dict-like outputs."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            out = self.inner(**dict(zip(names, args)))
            return out if isinstance(out, torch.Tensor) else out[0]

    wrapped = FirstOutput(model).eval()
    feeds = _random_feeds(entry.inputs, 0)
    args = tuple(torch.from_numpy(feeds[n]) for n in names)
    reference, activations = _activation_scan(wrapped, args)
    tmp = path.with_name("export.onnx")
    with torch.no_grad():
        torch.onnx.export(wrapped, args, str(tmp), input_names=names, output_names=["output"],
                          opset_version=OPSET, dynamo=False, do_constant_folding=True)
    flushed = _flush_subnormals(tmp)
    # A partial file must never look built: the name appears only when complete.
    os.replace(tmp, path)
    params = sum(p.numel() for p in model.parameters())
    del model, wrapped
    gc.collect()
    return {"parameters": params, "subnormal_initializers_flushed": flushed, **activations,
            "_reference": (feeds, np.asarray(reference.detach().numpy()))}


def verify(path: Path, entry: Entry, reference=None) -> dict:
    """Load ``path`` with onnxruntime (CPU, 1 thread) and run it once."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    t0 = time.perf_counter()
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    load_s = time.perf_counter() - t0
    feeds = reference[0] if reference else _random_feeds(entry.inputs, 0)
    inputs = [{"name": i.name, "shape": i.shape, "type": i.type} for i in session.get_inputs()]
    missing = [i["name"] for i in inputs if i["name"] not in feeds]
    if missing:
        raise RuntimeError(f"model has inputs the table does not describe: {missing}")
    feeds = {i["name"]: feeds[i["name"]] for i in inputs}
    t0 = time.perf_counter()
    outputs = session.run(None, feeds)
    run_s = time.perf_counter() - t0
    if not all(np.isfinite(o).all() for o in outputs if o.dtype.kind == "f"):
        raise RuntimeError("onnxruntime output is not finite")
    record = {"inputs": inputs,
              "outputs": [{"name": o.name, "shape": o.shape, "type": o.type}
                          for o in session.get_outputs()],
              "load_s": round(load_s, 4), "run_s": round(run_s, 4)}
    if reference:
        ref = reference[1]
        diff = float(np.abs(outputs[0] - ref).max())
        record["max_abs_diff_vs_torch"] = diff
        record["max_abs_torch_output"] = float(np.abs(ref).max())
        # Relative to the output's scale: fp32 reassociation differs by ~1e-6 of it.
        if not diff <= 1e-3 * record["max_abs_torch_output"]:
            raise RuntimeError(f"onnxruntime output differs from torch's by {diff:.3g}")
    return record


def file_bytes(path: Path) -> int:
    """The model file plus any external data next to it."""
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.is_file())


def export_main(args: argparse.Namespace) -> int:
    import warnings

    import onnx
    import onnxruntime
    import torch
    import transformers

    # The TorchScript exporter warns on every data-dependent branch it freezes; with
    # static shapes those are intended, and the warnings would bury the one-line reports.
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = {"models": {}}
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            pass
    models = manifest.setdefault("models", {})
    manifest.update({
        "schema_version": SCHEMA_VERSION,
        "context": {"torch": torch.__version__, "transformers": transformers.__version__,
                    "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                    "opset": OPSET, "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "ort_threads": 1},
    })

    def save_manifest() -> None:
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, manifest_path)

    wanted = args.only.split(",") if args.only else [e.name for e in MODELS]
    for name in list(wanted):  # a quantized model asked for alone brings its float model
        base = BY_NAME[name].base
        if base and base not in wanted and not (out / base / "model.onnx").exists():
            wanted.insert(wanted.index(name), base)
    built, skipped, failed = [], [], []
    for name in wanted:
        entry = BY_NAME[name]
        path = out / name / "model.onnx"
        try:
            if path.exists() and not args.force:
                skipped.append(name)
                if name not in models:  # a file from an earlier run without its record
                    models[name] = {"family": entry.family, "bytes": file_bytes(path),
                                    **verify(path, entry)}
                    save_manifest()
                continue
            t0 = time.perf_counter()
            path.parent.mkdir(parents=True, exist_ok=True)
            reference = None
            if entry.base:
                src = out / entry.base / "model.onnx"
                if not src.exists():
                    raise RuntimeError(f"its float model {entry.base} could not be built")
                tmp = path.with_name("export.onnx")
                info = entry.build(src, tmp, entry)
                info.update(quantized_from=entry.base,
                            subnormal_initializers_flushed=_flush_subnormals(tmp))
                os.replace(tmp, path)
            else:
                info = export_torch(entry, path)
                reference = info.pop("_reference")
            export_s = time.perf_counter() - t0
            record = {"family": entry.family, "bytes": file_bytes(path),
                      "export_s": round(export_s, 2), **info, **verify(path, entry, reference)}
            models[name] = record
            save_manifest()
            built.append(name)
            print(f"modern_corpus: built {name}: {record['bytes'] / 1e6:.1f} MB, export "
                  f"{export_s:.1f} s, one run {record['run_s'] * 1e3:.1f} ms", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - one failed model must not stop the corpus
            cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
            print(f"modern_corpus: {name}: failed: {cause}", file=sys.stderr)
            if args.verbose:
                traceback.print_exc()
            failed.append({"name": name, "error": cause})
            models.pop(name, None)
            for leftover in (path, path.with_name("export.onnx")):
                leftover.unlink(missing_ok=True)
            if path.parent.exists() and not any(path.parent.iterdir()):
                path.parent.rmdir()
            save_manifest()
        gc.collect()

    print(json.dumps({"schema_version": SCHEMA_VERSION, "out": str(out), "built": built,
                      "skipped": skipped, "failed": failed,
                      "seconds": round(time.perf_counter() - start + args.setup_s, 1)}))
    return 0 if built or skipped or not wanted else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "modern"), help="corpus folder")
    parser.add_argument("--venv", default=str(ROOT / "venv"), help="torch's virtual environment")
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--force", action="store_true", help="rebuild models already there")
    parser.add_argument("--list", action="store_true", help="print the model names and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failures")
    parser.add_argument("--_export", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_setup-s", dest="setup_s", type=float, default=0.0,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in BY_NAME]
        if unknown:
            parser.error(f"unknown model(s): {', '.join(unknown)} (see --list)")
    if args.list:
        for e in MODELS:
            print(f"{e.name}\t{e.family}" + (f"\tfrom {e.base}" if e.base else ""))
        return 0
    if args._export:
        return export_main(args)
    t0 = time.perf_counter()
    py = ensure_venv(Path(args.venv).expanduser())
    argv = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    os.execv(str(py), [str(py), os.path.abspath(__file__), *argv, "--_export",
                       "--_setup-s", f"{time.perf_counter() - t0:.3f}"])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
