"""Per-example image transforms in TensorFlow ops, for ``tf.data`` ``map`` (graph mode).

Both transforms take the encoded bytes of one image and return uint8 ``[S, S, 3]``:

* ``train_transform``: Inception-style random-resized crop *fused into JPEG decoding* (only
  the crop window is decoded: ``tf.image.decode_and_crop_jpeg``), bilinear resize to S x S,
  random horizontal flip. Every random choice is stateless, from ``seed`` (shape [2]), so
  the same seed gives the same output on any host and after a restart.
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


def _random_window(shape, seed, min_scale, max_scale, ratio):
    """A random-resized-crop window of an image of ``shape`` [h, w, c]; the centre crop where
    sampling fails."""
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


def _decode_window(image_bytes, window_fn):
    """Decodes only ``window_fn(shape)`` of a JPEG; other formats decode fully and slice."""

    def jpeg():
        shape = tf.image.extract_jpeg_shape(image_bytes)
        oy, ox, h, w = window_fn(shape)
        return tf.image.decode_and_crop_jpeg(image_bytes, tf.stack([oy, ox, h, w]), channels=3)

    def other():
        image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        image = tf.image.convert_image_dtype(image, tf.uint8)  # 16-bit PNGs
        oy, ox, h, w = window_fn(tf.shape(image))
        return tf.slice(image, tf.stack([oy, ox, 0]), tf.stack([h, w, 3]))

    return tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)


def _resize_uint8(image, image_size: int):
    x = tf.image.resize(image, [image_size, image_size], method="bilinear", antialias=False)
    x = tf.cast(tf.clip_by_value(tf.round(x), 0.0, 255.0), tf.uint8)
    return tf.ensure_shape(x, [image_size, image_size, 3])


def train_transform(
    image_bytes,
    seed,
    image_size: int,
    min_scale: float = 0.08,
    max_scale: float = 1.0,
    ratio=(3 / 4, 4 / 3),
    flip: bool = True,
):
    """Random-resized crop (fused decode) + resize + flip -> uint8 ``[S, S, 3]``.

    ``seed``: int32/int64 tensor of shape [2]; all randomness derives from it.
    """
    seeds = tf.random.experimental.stateless_split(seed, num=2)
    box_seed, flip_seed = seeds[0], seeds[1]

    def window(shape):
        return _random_window(shape, box_seed, min_scale, max_scale, ratio)

    image = _resize_uint8(_decode_window(image_bytes, window), image_size)
    if flip:
        image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    return image


def eval_transform(image_bytes, image_size: int, crop_ratio: float = 0.875):
    """Centre crop of ``crop_ratio`` x the shorter side (fused decode), resized -> ``[S, S, 3]``."""
    return _resize_uint8(
        _decode_window(image_bytes, lambda shape: _center_window(shape, crop_ratio)), image_size
    )
