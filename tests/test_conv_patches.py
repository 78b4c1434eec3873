"""Conv patches by strided slices against ``lax.conv_general_dilated_patches``.

``ConvGeometry.patches`` uses slices on the CPU and JAX's patches op
elsewhere (chosen when lowering); both must give the same rows in the
kernel's ``[*spatial, c_in]`` flatten order, exactly.
"""

import jax
from jax import lax
import numpy as np
import pytest

from kfac_jax_lite.blocks import conv

# (input shape, kernel shape, strides, padding, lhs_dilation, rhs_dilation,
#  dimension numbers)
CASES = [
    ((3, 9, 9, 3), (3, 3, 3, 5), (1, 1), "SAME", None, None,
     ("NHWC", "HWIO", "NHWC")),
    ((3, 9, 10, 3), (3, 2, 3, 5), (2, 1), "VALID", None, (1, 2),
     ("NHWC", "HWIO", "NHWC")),
    ((3, 3, 9, 10), (5, 3, 4, 3), (2, 3), ((1, 2), (0, 1)), (2, 1), None,
     ("NCHW", "OIHW", "NCHW")),
    ((3, 3, 8), (5, 3, 3), (1,), ((2, -1),), None, (2,),
     ("NCH", "OIH", "NCH")),
    ((2, 6, 7, 5, 2), (3, 2, 2, 2, 4), (1, 2, 1), "SAME", None, None,
     ("NDHWC", "DHWIO", "NDHWC")),
    ((3, 1, 28, 28), (8, 1, 4, 4), (2, 2), "VALID", None, None,
     ("NCHW", "OIHW", "NCHW")),
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_sliced_patches_equal_conv_patches(case):
  x_shape, k_shape, strides, padding, lhs_dil, rhs_dil, spec = case
  dn = lax.conv_dimension_numbers(x_shape, k_shape, spec)
  geo = conv.ConvGeometry(k_shape, strides, padding, lhs_dil, rhs_dil, dn)
  x = jax.random.normal(jax.random.PRNGKey(0), x_shape)
  want = np.asarray(geo.conv_patches(x))
  got = np.asarray(geo.sliced_patches(x))
  assert got.shape == (x_shape[0], want.shape[1], geo.patch_size)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(geo.patches(x)), want)


def test_patches_pick_slices_on_cpu_only():
  """The CPU program has no convolution in the patches; others keep it."""
  dn = lax.conv_dimension_numbers((2, 6, 6, 2), (3, 3, 2, 4),
                                  ("NHWC", "HWIO", "NHWC"))
  geo = conv.ConvGeometry((3, 3, 2, 4), (1, 1), "SAME", None, None, dn)
  x = jax.ShapeDtypeStruct((2, 6, 6, 2), np.float32)
  lowered = {p: jax.jit(geo.patches).trace(x).lower(
      lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda")}
  assert "convolution" not in lowered["cpu"]
  assert "convolution" in lowered["cuda"]
