"""masktrl's rules inside other trainers (docs/ECOSYSTEM.md).

* ``masktrl.integrations.trl``: ``MasktrlGRPOTrainer``, TRL's ``GRPOTrainer`` with its loss
  replaced by any masktrl rule and the behaviour's top-K lists recorded during generation.
* ``masktrl.integrations.verl``: ``policy_loss(spec)``, a function with the signature of verl's
  ``core_algos.py`` policy-loss registry, and ``register(name, spec)``.

Both rest on ``masktrl.integrations.tokens``: padded [B, T] tensors as a ``TokenBatch`` and a
rule's loss on it, computed exactly as masktrl's own update does (corrected token losses, the
regularisers, the aggregation). Nothing in masktrl imports this package; it imports only the
config, the method spec and the methods.
"""
