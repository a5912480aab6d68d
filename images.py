"""Reading one image file, for every loader of the repo (data.py's, robustness.py's): PIL's 8-bit RGB image, with the
files PIL would mis-read (16-bit greyscale) or raise on outside its usual errors (a decompression bomb) handled, and
the one-line reason a file could not be read, named from the exception's type. --decode gpu (loader.decode_batch)
reads every file that is not a plain JPEG through load_rgb too: both decoders give the same pixels (plain_jpeg)."""
import io

import numpy as np
from PIL import Image

from utils import UserError


class UnsupportedImage(ValueError):
    """An image whose pixels have no known 8-bit reading (32-bit integer or float)."""


# What a loader catches for "this file cannot be read": PIL's errors for an unidentifiable, truncated or broken file,
# and its DecompressionBombError (an Exception only) for an image over 2 x Image.MAX_IMAGE_PIXELS.
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def load_rgb(file):
    """The image in file (a path, or a binary file object) as an 8-bit RGB PIL image. 16-bit greyscale (PNG, TIFF:
    modes I;16*) is scaled to 8 bits (v / 257, rounded): PIL's convert('RGB') clips it to 255, an almost white
    image. 32-bit integer or float pixels (modes I, F) have no known range: refused (UnsupportedImage)."""
    with Image.open(file) as img:
        if img.mode.startswith('I;16'):
            level = np.asarray(img).astype(np.float64) / 257
            return Image.fromarray(np.round(level).astype(np.uint8), 'L').convert('RGB')
        if img.mode in ('I', 'F'):
            raise UnsupportedImage(f'{img.mode} mode ({"32-bit integer" if img.mode == "I" else "float"}) pixels of '
                                   'no known range; save it with 8 or 16 bits per channel')
        return img.convert('RGB')


def read_rgb(path):
    """load_rgb(path), or one line naming the file and why it cannot be read (unreadable, truncated, a broken PNG, a
    decompression bomb, 32-bit pixels)."""
    try:
        return load_rgb(path)
    except UNREADABLE as e:
        raise UserError(f'cannot decode {path}: {unreadable_reason(e)}') from None


def plain_jpeg(data):
    """Whether a file's bytes are a JPEG that torchvision.io.decode_jpeg(mode=RGB) decodes to load_rgb's pixels on
    every device: 8-bit RGB or greyscale (not CMYK, which nvJPEG has no conversion of; not a PNG, GIF, 16-bit or
    other file named .JPEG). From the header only (PIL's, ~40 us against ~4 ms to decode a 500 x 375 JPEG); a file
    PIL refuses there (no image, a decompression bomb) raises what load_rgb raises (UNREADABLE)."""
    with Image.open(io.BytesIO(data)) as img:
        return img.format == 'JPEG' and img.mode in ('RGB', 'L')


def unreadable_reason(e):
    """Why an image could not be read, from the type of the exception load_rgb raised (not from its text)."""
    if isinstance(e, Image.DecompressionBombError):
        return f"it has more than {2 * Image.MAX_IMAGE_PIXELS:,} pixels, PIL's decompression-bomb limit"
    if isinstance(e, OSError) and e.errno:  # the file system's (permission denied, a file gone), not the image's
        return e.strerror
    return str(e) if isinstance(e, UnsupportedImage) else 'corrupt or truncated'  # (PIL's text repeats the path)


def reread_reason(path):
    """The reason a loader worker could not read path (its exception cannot leave the worker whole): read it again."""
    try:
        load_rgb(path)
    except UNREADABLE as e:
        return unreadable_reason(e)
    return 'corrupt or truncated'  # (read on the second try: a file that changed, or a transform's failure)


def check_decoded(dataset, y):
    """Labels y of a batch of ImageFolder (above): one < 0 is an image that could not be read; name it. y on the
    CPU (no host sync)."""
    if (y < 0).any():
        path = dataset.samples[-1 - int(y.min())][0]
        raise UserError(f'cannot decode the image {path} ({reread_reason(path)}); replace or delete it')


def decoded_images(batch, dataset):
    """The images of a DataLoader batch (images, labels) of data.ImageFolder, once check_decoded found them readable."""
    check_decoded(dataset, batch[1])
    return batch[0]
