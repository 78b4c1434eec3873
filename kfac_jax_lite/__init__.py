"""kfac_jax_lite: K-FAC for JAX as a pure optax transform.

Martens & Grosse (2015), "Optimizing Neural Networks with Kronecker-factored
Approximate Curvature"; Grosse & Martens (2016) for convolutions; Martens, Ba
& Johnson (2018) for multi-use layers.
"""

from kfac_jax_lite.collection import APPROXIMATIONS
from kfac_jax_lite.collection import Layer
from kfac_jax_lite.collection import LayerCollection
from kfac_jax_lite.conv2d_tags import register_conv2d
from kfac_jax_lite.conv2d_tags import register_depthwise_conv2d
from kfac_jax_lite.conv2d_tags import register_separable_conv2d
from kfac_jax_lite.curvature import CurvatureState
from kfac_jax_lite.curvature import update_curvature
from kfac_jax_lite.estimator import EstimatorState
from kfac_jax_lite.estimator import FisherEstimator
from kfac_jax_lite.estimator import Stats
from kfac_jax_lite.evaluation import eval_losses
from kfac_jax_lite.evaluation import eval_losses_on_samples
from kfac_jax_lite.evaluation import loss_value
from kfac_jax_lite.evaluation import total_loss
from kfac_jax_lite.evaluation import total_sampled_loss
from kfac_jax_lite.linked import link_parameters
from kfac_jax_lite.loss_tags import register_categorical_predictive_distribution
from kfac_jax_lite.loss_tags import register_loss_function
from kfac_jax_lite.loss_tags import register_multi_bernoulli_predictive_distribution
from kfac_jax_lite.loss_tags import register_normal_predictive_distribution
from kfac_jax_lite.loss_tags import register_sigmoid_cross_entropy_loss
from kfac_jax_lite.loss_tags import register_softmax_cross_entropy_loss
from kfac_jax_lite.loss_tags import register_squared_error_loss
from kfac_jax_lite.eigen_adam import EigenAdamState
from kfac_jax_lite.eigen_adam import kfac_soap
from kfac_jax_lite.eigen_adam import rotated_layers
from kfac_jax_lite.eigen_adam import scale_by_kfac_eigen_adam
from kfac_jax_lite.grafting import GraftState
from kfac_jax_lite.grafting import graft
from kfac_jax_lite.grafting import kfac_adamw
from kfac_jax_lite.losses import LossSpec
from kfac_jax_lite.one_pass import value_grad_and_stats
from kfac_jax_lite.optimizer import KFACOptimizerState
from kfac_jax_lite.optimizer import kfac_optimizer
from kfac_jax_lite.scanner import scan
from kfac_jax_lite.sharded import ShardedState
from kfac_jax_lite.sharded import curvature_plan
from kfac_jax_lite.sharded import relayout_curvature
from kfac_jax_lite.tags import register_conv
from kfac_jax_lite.tags import register_convolution
from kfac_jax_lite.tags import register_dense
from kfac_jax_lite.tags import register_embedding
from kfac_jax_lite.tags import register_fully_connected
from kfac_jax_lite.tags import register_generic
from kfac_jax_lite.tags import register_scale_and_shift
from kfac_jax_lite.transform import SkipNonFiniteState
from kfac_jax_lite.transform import kfac
from kfac_jax_lite.transform import scale_by_kfac
from kfac_jax_lite.transform import skip_nonfinite

__all__ = [
    "APPROXIMATIONS",
    "CurvatureState",
    "EigenAdamState",
    "EstimatorState",
    "FisherEstimator",
    "GraftState",
    "KFACOptimizerState",
    "Layer",
    "LayerCollection",
    "LossSpec",
    "ShardedState",
    "SkipNonFiniteState",
    "Stats",
    "eval_losses",
    "eval_losses_on_samples",
    "graft",
    "curvature_plan",
    "kfac",
    "kfac_adamw",
    "kfac_optimizer",
    "kfac_soap",
    "link_parameters",
    "loss_value",
    "relayout_curvature",
    "register_categorical_predictive_distribution",
    "register_conv",
    "register_conv2d",
    "register_convolution",
    "register_dense",
    "register_depthwise_conv2d",
    "register_embedding",
    "register_fully_connected",
    "register_generic",
    "register_loss_function",
    "register_multi_bernoulli_predictive_distribution",
    "register_normal_predictive_distribution",
    "register_scale_and_shift",
    "register_separable_conv2d",
    "register_sigmoid_cross_entropy_loss",
    "register_softmax_cross_entropy_loss",
    "register_squared_error_loss",
    "rotated_layers",
    "scale_by_kfac_eigen_adam",
    "scale_by_kfac",
    "scan",
    "skip_nonfinite",
    "total_loss",
    "total_sampled_loss",
    "update_curvature",
    "value_grad_and_stats",
]

# The one place the version is written; pyproject.toml reads it.
__version__ = "0.1.0"
