"""transformers' torchvision processors, run without torchvision (it has no wheel that loads against this CPU torch
build): the one call of theirs that matters, `tvF.resize(uint8 image, bicubic, antialias=True)`, hands the uint8
tensor to torch's native uint8 kernel on the CPU (torchvision 0.28/0.29, read from its source); the stub does exactly
that (and `normalize`, the video processors', as torchvision writes it), so the rest of each processor -- the size
rule, the rescale, the patches, the positions, the padding -- runs as transformers wrote it."""
from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch


def torchvision_stub() -> dict[str, types.ModuleType]:
    """The stand-in modules (see the module docstring), by their import names."""
    functional = types.ModuleType("torchvision.transforms.v2.functional")

    def resize(image, size, interpolation=None, antialias=True):
        assert image.dtype == torch.uint8 and antialias
        batch = image if image.ndim == 4 else image[None]           # a video's frames, or one image
        out = torch.nn.functional.interpolate(batch, size=list(size), mode="bicubic", align_corners=False,
                                              antialias=True)
        return out if image.ndim == 4 else out[0]

    def normalize(image, mean, std, inplace=False):
        """torchvision's `normalize` on a float tensor: (x - mean) / std per channel (the video processor's 1/255)."""
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

    functional.resize = resize
    functional.normalize = normalize
    functional.InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic")
    v2 = types.ModuleType("torchvision.transforms.v2")
    v2.functional = functional
    transforms = types.ModuleType("torchvision.transforms")
    transforms.v2 = v2
    root = types.ModuleType("torchvision")
    root.transforms = transforms
    return {"torchvision": root, "torchvision.transforms": transforms, "torchvision.transforms.v2": v2,
            "torchvision.transforms.v2.functional": functional}


def import_stubbed(module: str, name: str):
    """`name` of transformers' `module` imported with torchvision stubbed (the 12B's processors import it at module
    level; the 4-model family's video processor only when transformers finds it installed: told so meanwhile)."""
    import transformers.utils

    importlib.import_module("transformers.image_processing_backends")     # before the stub: it asks for torchvision
    importlib.import_module("transformers.video_processing_utils")
    stubs = torchvision_stub()
    saved = {n: sys.modules.get(n) for n in stubs}
    available = transformers.utils.is_torchvision_v2_available
    sys.modules.update(stubs)
    sys.modules.pop(module, None)
    transformers.utils.is_torchvision_v2_available = lambda: True
    try:
        return getattr(importlib.import_module(module), name)
    finally:
        transformers.utils.is_torchvision_v2_available = available
        sys.modules.pop(module, None)
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@contextlib.contextmanager
def stubbed_normalize():
    """The video processors' rescale-and-normalize reaches torchvision through the backends module's global `tvF`."""
    backends = importlib.import_module("transformers.image_processing_backends")
    had = getattr(backends, "tvF", None)
    backends.tvF = torchvision_stub()["torchvision.transforms.v2.functional"]
    try:
        yield
    finally:
        if had is None:
            del backends.tvF
        else:
            backends.tvF = had
