"""Finds layers in a traced loss function; builds the collection.

Two jobs, both on the jaxpr of ``loss_fn(params, batch)``:

1. :func:`scan` walks the jaxpr at every nesting depth (``jit``,
   ``checkpoint``, ``custom_jvp``/``custom_vjp``, ``cond``, ``scan``) and
   keeps, for every value, a few *facts*: which parameter leaves it depends
   on, whether it is a plain *view* of one leaf (a cast, a row-major
   reshape, a leading broadcast, a transpose), whether it depends on the
   batch. From these it finds layer **sites**: the layer tags, and with
   ``auto_register=True`` the untagged layers of :mod:`flax`, Equinox and
   plain-JAX code (``dot_general`` dense layers in either operand order,
   with an optional bias ``add``,
   ``conv_general_dilated`` (depthwise when ``feature_group_count == C``),
   ``gather`` / one-hot embeddings and their ``x @ table.T`` tied output
   projections, scale-and-shift ``mul``/``add`` chains of normalisation
   layers). A site perturbs the
   output of one equation and records the layer inputs that are live at
   that point, laid out as the matching tag's inputs would be.

2. :func:`perturbed_fn` re-evaluates the jaxpr with a perturbation added to
   every site's output and returns the recorded layer inputs and the loss
   tags' operands. The derivative with respect to a zero perturbation is the
   loss gradient at the layer output, so a single ``jax.vjp`` gives the
   parameter gradient and every layer's output gradients. Equations that
   contain no site are re-bound unchanged; loops that contain sites are
   rebuilt with ``lax.scan`` / ``lax.switch`` so the perturbations become
   extra scanned inputs and the recorded inputs extra scanned outputs.

Soundness rules of automatic recognition (a layer block must see *every*
way its parameters reach the loss):

* a parameter leaf belongs to an automatic layer only if every use of it
  that reaches a loss tag is a recognised site of that layer; otherwise the
  leaf falls back to a generic block and ``describe()`` says which use was
  not recognised (e.g. ``jnp.sin(w)``); the lookups of a table and its
  ``x @ table.T`` output projections (tied embeddings) are one layer;
* a site's input must depend on the batch, so that its leading axis is the
  batch axis;
* manual tags win: an automatic site that touches a tagged leaf is dropped.

Modules: ``facts`` (what the walk knows about a value; sites), ``walk``
(the recursive walk, :func:`find_sites`, the soundness rules), ``match``
(recognising untagged layers on single equations), ``collect``
(:func:`scan`: sites to layers and fallbacks), ``interpret``
(:func:`perturbed_fn`). This package and :mod:`kfac_jax_lite.tags` are the
only ones that touch jaxpr internals (``jax.extend.core``).
"""

from kfac_jax_lite.scanner.collect import scan
from kfac_jax_lite.scanner.facts import LossSite
from kfac_jax_lite.scanner.facts import Site
from kfac_jax_lite.scanner.interpret import Traced
from kfac_jax_lite.scanner.interpret import perturbed_fn
from kfac_jax_lite.scanner.walk import find_sites

__all__ = ["LossSite", "Site", "Traced", "find_sites", "perturbed_fn", "scan"]
