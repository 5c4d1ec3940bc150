"""Per-example image transforms in TensorFlow ops, for ``tf.data`` ``map`` (graph mode).

Both transforms take the encoded bytes of one image and return uint8 ``[S, S, 3]``:

* ``train_transform``: Inception-style random-resized crop *fused into JPEG decoding* (only
  the crop window is decoded: ``tf.image.decode_and_crop_jpeg``), at a reduced DCT scale
  (``ratio`` 2, 4 or 8 of libjpeg, as FFCV and DALI do) when the crop is at least that many
  times the output size, bilinear resize to S x S, random horizontal flip. Every random
  choice is stateless, from ``seed`` (shape [2]), so the same seed gives the same output on
  any host and after a restart.
* ``eval_transform``: the centre ``crop_ratio`` x (shorter side) square, fused into
  decoding, resized to S x S (crop_ratio 0.875 at 224 px is the usual "resize to 256,
  centre-crop 224").

Bytes that are not JPEG (PNG, GIF, BMP) take a slower path: full decode, then the same
window by ``tf.slice``. Grayscale and CMYK JPEGs come out RGB (``channels=3``).
"""

from __future__ import annotations

import tensorflow as tf

# The crop used when random-crop sampling fails (MLPerf / TF ResNet preprocessing).
FALLBACK_CROP_RATIO = 0.875


def _center_window(shape, crop_ratio: float):
    """(offset_y, offset_x, h, w) of the centred square of crop_ratio x the shorter side."""
    h, w = shape[0], shape[1]
    side = tf.cast(tf.round(crop_ratio * tf.cast(tf.minimum(h, w), tf.float32)), tf.int32)
    side = tf.clip_by_value(side, 1, tf.minimum(h, w))
    return (h - side + 1) // 2, (w - side + 1) // 2, side, side


def random_window(shape, seed, min_scale, max_scale, ratio):
    """A random-resized-crop window (offset_y, offset_x, h, w) of an image of ``shape``
    [h, w, c], drawn from ``seed`` (``train_transform`` passes the first of its seed split
    in two); the centre crop where sampling fails. ``min_scale`` 1: the whole image (which
    the sampler would return as its failure, and the fallback would shrink to the centre
    crop)."""
    if min_scale >= 1.0:
        return (tf.constant(0, tf.int32), tf.constant(0, tf.int32), shape[0], shape[1])
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4]),
        seed=seed,
        min_object_covered=0.0,  # the area range alone bounds the crop
        aspect_ratio_range=tuple(ratio),
        area_range=(min_scale, max_scale),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    # After max_attempts failures the op returns the whole image; like the TF/MLPerf ResNet
    # preprocessing, take that as failure and use the centre crop instead.
    failed = tf.logical_and(tf.equal(size[0], shape[0]), tf.equal(size[1], shape[1]))
    cy, cx, ch, cw = _center_window(shape, FALLBACK_CROP_RATIO)
    return (
        tf.where(failed, cy, begin[0]),
        tf.where(failed, cx, begin[1]),
        tf.where(failed, ch, size[0]),
        tf.where(failed, cw, size[1]),
    )


# DCT scales of libjpeg (TensorFlow's ``ratio``): decoding at 1/r costs far fewer IDCT and
# colour-conversion operations, and the scaled IDCT is itself a low-pass filter.
DCT_RATIOS = (1, 2, 4, 8)


def dct_ratio(crop_h, crop_w, image_size: int):
    """The largest DCT scale 1/r (r in 1, 2, 4, 8) at which the crop still has at least
    ``image_size`` pixels on its shorter side: the index into ``DCT_RATIOS``."""
    short = tf.minimum(crop_h, crop_w)
    steps = [tf.cast(short >= r * image_size, tf.int32) for r in DCT_RATIOS[1:]]
    return steps[0] + steps[1] + steps[2]  # the conditions are nested: 8x implies 4x implies 2x


def decode_crop_jpeg(image_bytes, shape, window, image_size):
    """``decode_and_crop_jpeg`` of ``window`` (original pixel coordinates) of a JPEG of
    ``shape``, at the DCT scale that ``dct_ratio`` picks; ``image_size`` None decodes at
    full scale. Both transforms decode their JPEG windows through it."""
    oy, ox, h, w = window

    def at(r):
        def decode():
            if r == 1:
                return tf.image.decode_and_crop_jpeg(
                    image_bytes, tf.stack([oy, ox, h, w]), channels=3
                )
            # The window in the coordinates of the 1/r image (ceil(H/r) x ceil(W/r)): its
            # edges move by at most r/2 original pixels, under half an output pixel since the
            # crop is >= r x image_size.
            hs, ws = (shape[0] + r - 1) // r, (shape[1] + r - 1) // r
            y0 = tf.minimum((oy + r // 2) // r, hs - 1)
            x0 = tf.minimum((ox + r // 2) // r, ws - 1)
            y1 = tf.clip_by_value((oy + h + r // 2) // r, y0 + 1, hs)
            x1 = tf.clip_by_value((ox + w + r // 2) // r, x0 + 1, ws)
            crop = tf.stack([y0, x0, y1 - y0, x1 - x0])
            return tf.image.decode_and_crop_jpeg(image_bytes, crop, channels=3, ratio=r)

        return decode

    if image_size is None:
        return at(1)()
    return tf.switch_case(dct_ratio(h, w, image_size), [at(r) for r in DCT_RATIOS])


def _decode_window(image_bytes, window_fn, image_size=None, jpeg_only=False):
    """Decodes only ``window_fn(shape)`` of a JPEG (at a reduced DCT scale where the window is
    at least 2x ``image_size``; None: full scale); other formats decode fully and slice.
    ``jpeg_only``: the bytes are known to be JPEG (prepared records), so no format test."""

    def jpeg():
        shape = tf.image.extract_jpeg_shape(image_bytes)
        return decode_crop_jpeg(image_bytes, shape, window_fn(shape), image_size)

    def other():
        image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        image = tf.image.convert_image_dtype(image, tf.uint8)  # 16-bit PNGs
        oy, ox, h, w = window_fn(tf.shape(image))
        return tf.slice(image, tf.stack([oy, ox, 0]), tf.stack([h, w, 3]))

    if jpeg_only:
        return jpeg()
    return tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)


def _resize_uint8(image, image_size: int):
    x = tf.image.resize(image, [image_size, image_size], method="bilinear", antialias=False)
    # Bilinear weights are convex, so x is already in [0, 255]: round half up, no clip.
    x = tf.cast(x + 0.5, tf.uint8)
    return tf.ensure_shape(x, [image_size, image_size, 3])


def train_transform(
    image_bytes,
    seed,
    image_size: int,
    min_scale: float = 0.08,
    max_scale: float = 1.0,
    ratio=(3 / 4, 4 / 3),
    flip: bool = True,
    dct_scaling: bool = True,
    jpeg_only: bool = False,
    translate: int = 0,
):
    """Random-resized crop (fused decode) + resize + flip -> uint8 ``[S, S, 3]``, then with
    ``translate`` > 0 a random shift by up to that many pixels each way (reflect-padded).

    ``seed``: int32/int64 tensor of shape [2]; all randomness derives from it. The crop
    window is drawn from the original size whatever the decoding scale, so ``dct_scaling``
    (decode at 1/2, 1/4, 1/8 where the crop is that much larger than S) keeps the
    augmentation's distribution; False decodes every crop at full scale.
    """
    seeds = tf.random.experimental.stateless_split(seed, num=2)
    box_seed, flip_seed = seeds[0], seeds[1]

    def window(shape):
        return random_window(shape, box_seed, min_scale, max_scale, ratio)

    scale_for = image_size if dct_scaling else None
    image = _resize_uint8(_decode_window(image_bytes, window, scale_for, jpeg_only), image_size)
    if translate > 0:  # its own seed, split off the flip's (the other draws stay as they were)
        shift_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(flip_seed, 2))
        t = int(translate)
        padded = tf.pad(image, [[t, t], [t, t], [0, 0]], mode="REFLECT")
        image = tf.image.stateless_random_crop(padded, tf.shape(image), shift_seed)
    if flip:
        image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    return image


def eval_transform(
    image_bytes,
    image_size: int,
    crop_ratio: float = 0.875,
    dct_scaling: bool = True,
    jpeg_only: bool = False,
):
    """Centre crop of ``crop_ratio`` x the shorter side (fused decode), resized -> ``[S, S, 3]``."""
    window = lambda shape: _center_window(shape, crop_ratio)  # noqa: E731
    scale_for = image_size if dct_scaling else None
    return _resize_uint8(_decode_window(image_bytes, window, scale_for, jpeg_only), image_size)
