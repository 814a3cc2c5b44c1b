"""Rendered frames as an MP4: H.264 in yuv420p, byte-stable (identical frames give identical bytes on any host).

The colour conversion is FFmpeg's (swscale, through PyAV) with its bit-exact flags: BT.709 into limited ("MPEG")
range, each chroma sample the mean of its 2x2 block (the AREA filter); BITEXACT with ACCURATE_RND keeps swscale off
the SIMD paths whose rounding differs between CPUs. Grey stays exactly 128 in both chroma planes.
"""

from __future__ import annotations

import io

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace, Interpolation

CONTENT_TYPE_MP4 = "video/mp4"

# x264 writes its settings (thread count included) into the stream, so a fixed count keeps bytes host-independent.
_X264_THREADS = 4
# mbtree off: with it, the bundled x264 (core 165, av 18.1.0) gave different bytes for identical input, run to run.
_X264_OPTIONS = {"preset": "medium", "crf": "18", "x264-params": "mbtree=0"}
_TO_YUV = Interpolation.AREA | Interpolation.ACCURATE_RND | Interpolation.BITEXACT


def _yuv420p(frame: np.ndarray) -> av.VideoFrame:
    """One HxWx3 uint8 RGB frame as a BT.709 limited-range yuv420p frame."""
    rgb = av.VideoFrame.from_ndarray(frame, format="rgb24")
    return rgb.reformat(
        format="yuv420p",
        dst_colorspace=Colorspace.ITU709,
        src_color_range=ColorRange.JPEG,
        dst_color_range=ColorRange.MPEG,
        interpolation=_TO_YUV,
        threads=1,
    )


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """H.264/yuv420p MP4 bytes for FxHxWx3 uint8 RGB frames; identical frames give identical bytes."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected FxHxWx3 uint8 frames, got {frames.shape} {frames.dtype}")
    count, height, width, _ = frames.shape
    if count < 1 or height % 2 or width % 2:
        raise ValueError(f"H.264 yuv420p needs >= 1 frame and even sizes, got {count}x{width}x{height}")
    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        ctx = stream.codec_context
        ctx.flags |= av.codec.context.Flags.bitexact
        ctx.thread_count = _X264_THREADS
        ctx.options = dict(_X264_OPTIONS)
        ctx.colorspace = Colorspace.ITU709
        ctx.color_primaries = 1  # BT.709
        ctx.color_trc = 1
        ctx.color_range = ColorRange.MPEG
        for index in range(count):
            frame = _yuv420p(np.ascontiguousarray(frames[index]))
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def decode_mp4_info(data: bytes) -> tuple[int, int, int]:
    """(frames, width, height) of an MP4, counted by decoding it."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        return frames, stream.codec_context.width, stream.codec_context.height
