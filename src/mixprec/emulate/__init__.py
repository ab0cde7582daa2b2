"""Precision emulation: bit-exact rounding to low-precision formats, block-scaled formats (MX, NVFP4) with
:func:`mx_quantize`, matmuls with modelled accumulators (block-scaled ones too), the MXFP8 and NVFP4 training
recipes of :class:`EmulatedLinear`, and :func:`fingerprint`, which infers the accumulator model of a real matmul
from crafted inputs."""

from mixprec.core.formats import FORMAT_PRESETS, FloatFormat, get_format
from mixprec.core.mx import (
    MX_FORMATS,
    SCALE_MODES,
    BlockScaled,
    hadamard_transform,
    mx_quantize,
    random_signs,
)
from mixprec.core.rounding import ROUNDING_MODES, round_to, round_to_
from mixprec.emulate.fingerprints import Fingerprint, fingerprint
from mixprec.emulate.linear import EmulatedLinear, LinearSwap, emulate_linear_layers
from mixprec.emulate.matmul import (
    MATMUL_PRESETS,
    ErrorBounds,
    MatmulModel,
    bounds,
    get_matmul_model,
    matmul,
)
from mixprec.emulate.mx_matmul import BLOCK_ACCUMULATORS, matmul_block_scaled
from mixprec.emulate.recipes import RECIPES, BlockScaledRecipe, get_recipe

__all__ = [
    "BLOCK_ACCUMULATORS",
    "FORMAT_PRESETS",
    "MATMUL_PRESETS",
    "MX_FORMATS",
    "RECIPES",
    "ROUNDING_MODES",
    "SCALE_MODES",
    "BlockScaled",
    "BlockScaledRecipe",
    "EmulatedLinear",
    "ErrorBounds",
    "Fingerprint",
    "FloatFormat",
    "LinearSwap",
    "MatmulModel",
    "bounds",
    "emulate_linear_layers",
    "fingerprint",
    "get_format",
    "get_matmul_model",
    "get_recipe",
    "hadamard_transform",
    "matmul",
    "matmul_block_scaled",
    "mx_quantize",
    "random_signs",
    "round_to",
    "round_to_",
]
