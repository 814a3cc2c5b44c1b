"""Builds tiny random-weight video pipelines offline, for tests and local runs: text-to-video (Wan, CogVideoX,
LTX-Video, HunyuanVideo) and image-to-video (LTX-Video)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import string
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from taskgate.config import TINY_DEFAULTS, ModelSpec
from taskgate.families import FAMILIES

MODEL_NAME = "wan-tiny"

# Model name -> diffusers pipeline class; every tiny model obeys its real family's frame and size rules.
TINY_MODELS: dict[str, str] = {
    "wan-tiny": "WanPipeline",
    "cogvideox-tiny": "CogVideoXPipeline",
    "ltx-tiny": "LTXPipeline",
    "hunyuan-tiny": "HunyuanVideoPipeline",
    "ltx-i2v-tiny": "LTXImageToVideoPipeline",  # image-to-video: its requests carry an image
}

_WORDS_TEXT = (
    "a an the and of in on at with over under by to from is are this that cat dog bird fish horse monkey "
    "person man woman child robot car train boat plane runs walks jumps flies swims dances sits sleeps plays "
    "looks moves red blue green yellow white black orange purple bright dark sky sea ocean river forest city "
    "street room beach mountain snow rain sun moon day night morning evening light shadow fire water tree "
    "flower grass road video cinematic slow motion close up wide shot camera high quality blurry low"
)

# Same special-token layout as the real UMT5 tokenizer: pad=0, eos=1, unk=2.
_SPECIALS = ("<pad>", "</s>", "<unk>")
_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation


def tiny_vocab() -> list[tuple[str, float]]:
    """Unigram pieces and scores for the tiny tokenizer: whole words, then single characters as a fallback."""
    vocab: list[tuple[str, float]] = [(piece, 0.0) for piece in _SPECIALS]
    vocab += [("\u2581" + word, -2.0 - i * 0.01) for i, word in enumerate(_WORDS_TEXT.split())]
    vocab.append(("\u2581", -5.0))
    vocab += [(ch, -10.0 - i * 0.01) for i, ch in enumerate(_CHARS)]
    return vocab


def _bpe(
    words: list[str], symbols: list[str], first: list[str], last: Callable[[str], str]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A BPE vocabulary and merges that join each word's symbols left to right into one token."""
    vocab = {token: i for i, token in enumerate(dict.fromkeys([*first, *symbols]))}
    merges: list[tuple[str, str]] = []
    for word in dict.fromkeys(words):
        parts = [*word[:-1], last(word[-1])]
        for right in parts[1:]:
            left, joined = parts[0], parts[0] + right
            if joined not in vocab:
                vocab[joined] = len(vocab)
                merges.append((left, right))
            parts = [joined, *parts[2:]]
    return vocab, merges


def _t5(seed: int, umt5: bool) -> tuple[Any, Any]:
    """The in-memory Unigram tokenizer and a 2-layer (U)MT5 encoder with 32-wide outputs."""
    import torch
    from transformers import T5Config, T5EncoderModel, T5Tokenizer, UMT5Config, UMT5EncoderModel

    tokenizer = T5Tokenizer(vocab=tiny_vocab(), extra_ids=0)
    config: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(UMT5Config(**config)) if umt5 else T5EncoderModel(T5Config(**config))
    return tokenizer, encoder.eval()


def _wan(seed: int) -> Any:
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tokenizer, text_encoder = _t5(seed, umt5=True)
    torch.manual_seed(seed)
    # Spatial /8 and temporal /4 like the real Wan VAE, so the real frame/size rules apply.
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    torch.manual_seed(seed)
    # rope_max_seq_len bounds latent positions per axis: 32 covers up to 125 frames and 512 px.
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
    )


def _cogvideox(seed: int) -> Any:
    import torch
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    tokenizer, text_encoder = _t5(seed, umt5=False)
    torch.manual_seed(seed)
    # Four blocks: spatial /8 and temporal /4 like the real CogVideoX VAE; with patch 2, sizes are multiples of 16.
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    torch.manual_seed(seed)
    # max_text_seq_length matches the pipeline's default max_sequence_length (226), as in the real model.
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2, text_embed_dim=32,
        num_layers=2, sample_width=4, sample_height=4, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=226,
    )
    return CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(),
    )


def _ltx_components(seed: int) -> dict[str, Any]:
    """The tiny LTX-Video networks; the text and image pipeline classes take the same ones."""
    import torch
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    tokenizer, text_encoder = _t5(seed, umt5=False)
    torch.manual_seed(seed)
    # Patch 4 and three space-time downsamplings: spatial /32 and temporal /8 like the real LTX-Video VAE.
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4,
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    torch.manual_seed(seed)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=2, caption_channels=32,
    )
    return {
        "tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(),
    }


def _ltx(seed: int) -> Any:
    from diffusers import LTXPipeline

    return LTXPipeline(**_ltx_components(seed))


def _ltx_i2v(seed: int) -> Any:
    from diffusers import LTXImageToVideoPipeline

    # The VAE's encoder turns the input image into the first latent frame; the transformer is the text model's.
    return LTXImageToVideoPipeline(**_ltx_components(seed))


def _hunyuan(seed: int) -> Any:
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, LlamaConfig, LlamaModel, LlamaTokenizer

    # Llama side: the words of the tiny vocabulary and of the pipeline's prompt template, so the template stays
    # about as long in tokens as the real one's crop_start (95) and the prompt survives truncation.
    template = str(DEFAULT_PROMPT_TEMPLATE["template"])
    headers = sorted(set(re.findall(r"<\|[a-z_]+\|>", template)))
    template_words = re.findall(r"[A-Za-z]+", template)
    words = [*("\u2581" + w for w in [*_WORDS_TEXT.split(), *template_words]), *template_words]
    vocab, merges = _bpe(words, ["\u2581", *_CHARS, *headers], ["<unk>", "<s>", "</s>", "<pad>"], lambda ch: ch)
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": headers})
    # CLIP side: lower-case words, end-of-word marked as CLIP's BPE does.
    clip_vocab, clip_merges = _bpe(
        _WORDS_TEXT.split(), [*string.ascii_lowercase, *(c + "</w>" for c in string.ascii_lowercase + string.digits)],
        ["<|startoftext|>", "<|endoftext|>"], lambda ch: ch + "</w>",
    )
    # The tokenizers backend takes (left, right) pairs, whatever the annotation says.
    tokenizer_2 = CLIPTokenizer(vocab=clip_vocab, merges=clip_merges)  # type: ignore[arg-type]
    torch.manual_seed(seed)
    text_encoder = LlamaModel(LlamaConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=3, hidden_size=16, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer),
    )).eval()
    torch.manual_seed(seed)
    text_encoder_2 = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=8, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer_2), projection_dim=32,
    )).eval()
    torch.manual_seed(seed)
    # Spatial /8 and temporal /4 like the real HunyuanVideo VAE; with patch 2, sizes are multiples of 16.
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    torch.manual_seed(seed)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    return HunyuanVideoPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, tokenizer_2=tokenizer_2, text_encoder_2=text_encoder_2, vae=vae,
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


_BUILDERS: dict[str, Callable[[int], Any]] = {
    "WanPipeline": _wan,
    "CogVideoXPipeline": _cogvideox,
    "LTXPipeline": _ltx,
    "HunyuanVideoPipeline": _hunyuan,
    "LTXImageToVideoPipeline": _ltx_i2v,
}


def build_tiny_pipeline(folder: Path, seed: int = 0, pipeline: str = "WanPipeline") -> Path:
    """Build a tiny random-weight pipeline of the given diffusers class, save it into `folder` and return `folder`."""
    # Imported here so the CLI's "already built" path does not pay torch's import time.
    from transformers.utils import logging as transformers_logging

    if pipeline not in _BUILDERS:
        raise ValueError(f"no tiny {pipeline}; known: {', '.join(_BUILDERS)}")
    transformers_logging.disable_progress_bar()
    folder = Path(folder)
    pipe = _BUILDERS[pipeline](seed)
    # Save beside the target and rename, so a reader never sees a half-written pipeline.
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        pipe.save_pretrained(staging)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def tiny_spec(pipeline: str, folder: Path, **changes: Any) -> ModelSpec:
    """The registry entry of a tiny model: its family's rules with thumbnail-sized defaults."""
    return ModelSpec(path=folder, pipeline=pipeline, **{**TINY_DEFAULTS, **changes})


def tiny_models(task_type: str) -> dict[str, str]:
    """The tiny models of one task type ("text-to-video", "image-to-video"): model name -> pipeline class."""
    return {name: pipeline for name, pipeline in TINY_MODELS.items() if FAMILIES[pipeline].task_type == task_type}


def is_pipeline_folder(folder: Path) -> bool:
    """Whether `folder` already holds a saved diffusers pipeline."""
    return (Path(folder) / "model_index.json").is_file()


def default_folder(name: str = MODEL_NAME) -> Path:
    """Where a tiny model lives by default: <TASKGATE_STATE_DIR or .taskgate>/models/<name>."""
    return Path(os.environ.get("TASKGATE_STATE_DIR") or ".taskgate") / "models" / name


def main(argv: list[str] | None = None) -> int:
    """Command line: build a tiny model unless it is already there."""
    parser = argparse.ArgumentParser(prog="python -m taskgate_local.tinymodel", description=__doc__)
    parser.add_argument(
        "--model", choices=sorted(TINY_MODELS), default=MODEL_NAME, help="which tiny model (default wan-tiny)"
    )
    parser.add_argument("--out", type=Path, default=None, help="target folder (default: <state dir>/models/<model>)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder holds a pipeline")
    args = parser.parse_args(argv)
    out: Path = args.out if args.out is not None else default_folder(args.model)
    if is_pipeline_folder(out) and not args.force:
        print(f"{out}: pipeline already present")
        return 0
    build_tiny_pipeline(out, seed=args.seed, pipeline=TINY_MODELS[args.model])
    print(f"{out}: built {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
