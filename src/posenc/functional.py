"""Pure functions of every encoding family (the math, no state).

Each family module lists the functions it exports here in ``__functional__``; this module imports
them by name, so IDEs and type checkers see them (``tests/test_functional.py`` checks the two agree),
e.g. ``F.t5_bucket``, ``F.alibi_slopes``, ``F.sinusoidal``, ``F.rope_inv_freq``, ``F.apply_rope``,
``F.deberta_log_bucket``.
"""

from __future__ import annotations

from .encodings.alibi import alibi_slopes
from .encodings.axial_rope import axial_rope_cos_sin
from .encodings.clipped_rope import clip_inv_freq, clip_pairs_past
from .encodings.comrope import (
    apply_block_rotation,
    apply_power_rotation,
    block_rotations,
    comrope_generators,
    skew_exp,
    skew_part,
)
from .encodings.cope import cope_interpolate, cope_positions
from .encodings.dca import dca_position_maps
from .encodings.deberta import deberta_att_span, deberta_log_bucket, deberta_relative_index
from .encodings.dpe import dpe_group_of_pairs, dpe_position_maps
from .encodings.fire import fire_input
from .encodings.fope import apply_fope, fope_cos_sin, fope_init_coefficients, fope_inv_freq, fope_series
from .encodings.fox import fox_bias, fox_bias_at, fox_states
from .encodings.grape import apply_grape, grape_log_freq_init, grape_rank2_exp
from .encodings.grape_additive import grape_additive_lift
from .encodings.hope import hope_inv_freq
from .encodings.kerple import kerple_bias
from .encodings.learned import resample_positions
from .encodings.liere import liere_generators
from .encodings.mlp_bias import log_distance
from .encodings.mrope import default_mrope_section, mrope_axis_map, mrope_channel_axes, mrope_cos_sin
from .encodings.mrope_ids import (
    mrope_grid_ids,
    mrope_position_ids,
    videorope_grid_ids,
    videorope_position_ids,
)
from .encodings.path import (
    path_attention_blocked,
    path_carry_keys,
    path_householders,
    path_logits,
    path_ut,
)
from .encodings.relproj import relproj_bias
from .encodings.rerope import rerope_position_maps, rerope_relative_position
from .encodings.rope import apply_rope, convert_rope_pairing, rope_cos_sin, rope_inv_freq
from .encodings.rope_scaling import rope_scaled_inv_freq, rope_scaling_types
from .encodings.sandwich import sandwich_bias, sandwich_head_factors, sandwich_inv_freq
from .encodings.self_extend import self_extend_position_maps
from .encodings.shaw import shaw_relative_index, shaw_relative_logits, shaw_relative_values
from .encodings.sinusoidal import sinusoidal
from .encodings.sinusoidal2d import grid_row_col, sinusoidal_2d
from .encodings.string_rope import apply_string, cayley_orthogonal, string_init_freqs
from .encodings.string_shift import string_shift_position_maps
from .encodings.t5 import t5_bucket
from .encodings.vit_rope import (
    dinov3_augment_coords,
    dinov3_cos_sin,
    dinov3_patch_coords,
    dinov3_rope_inv_freq,
    rope_mixed_angles,
    rope_mixed_init_freqs,
    vit_patch_row_col,
)
from .encodings.xpos import apply_xpos, xpos_zeta

__all__ = [
    "alibi_slopes",
    "apply_block_rotation",
    "apply_fope",
    "apply_grape",
    "apply_power_rotation",
    "apply_rope",
    "apply_string",
    "apply_xpos",
    "axial_rope_cos_sin",
    "block_rotations",
    "cayley_orthogonal",
    "clip_inv_freq",
    "clip_pairs_past",
    "comrope_generators",
    "convert_rope_pairing",
    "cope_interpolate",
    "cope_positions",
    "dca_position_maps",
    "deberta_att_span",
    "deberta_log_bucket",
    "deberta_relative_index",
    "default_mrope_section",
    "dinov3_augment_coords",
    "dinov3_cos_sin",
    "dinov3_patch_coords",
    "dinov3_rope_inv_freq",
    "dpe_group_of_pairs",
    "dpe_position_maps",
    "fire_input",
    "fope_cos_sin",
    "fope_init_coefficients",
    "fope_inv_freq",
    "fope_series",
    "fox_bias",
    "fox_bias_at",
    "fox_states",
    "grape_additive_lift",
    "grape_log_freq_init",
    "grape_rank2_exp",
    "grid_row_col",
    "hope_inv_freq",
    "kerple_bias",
    "liere_generators",
    "log_distance",
    "mrope_axis_map",
    "mrope_channel_axes",
    "mrope_cos_sin",
    "mrope_grid_ids",
    "mrope_position_ids",
    "path_attention_blocked",
    "path_carry_keys",
    "path_householders",
    "path_logits",
    "path_ut",
    "relproj_bias",
    "rerope_position_maps",
    "rerope_relative_position",
    "resample_positions",
    "rope_cos_sin",
    "rope_inv_freq",
    "rope_mixed_angles",
    "rope_mixed_init_freqs",
    "rope_scaled_inv_freq",
    "rope_scaling_types",
    "sandwich_bias",
    "sandwich_head_factors",
    "sandwich_inv_freq",
    "self_extend_position_maps",
    "shaw_relative_index",
    "shaw_relative_logits",
    "shaw_relative_values",
    "sinusoidal",
    "sinusoidal_2d",
    "skew_exp",
    "skew_part",
    "string_init_freqs",
    "string_shift_position_maps",
    "t5_bucket",
    "videorope_grid_ids",
    "videorope_position_ids",
    "vit_patch_row_col",
    "xpos_zeta",
]
