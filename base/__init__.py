"""The base layer: what every other layer stands on and that knows nothing of draft heads.

* :mod:`selfspec.base.files`: the one strict JSON-to-dataclass reader and the atomic writers, the cache root.
* :mod:`selfspec.base.cpu_linear`: the CPU kernels a tree verification may use for its linear products.
* :mod:`selfspec.base.fingerprint`: the fingerprint of a target model, which heads and cost profiles carry.
* :mod:`selfspec.base.target`: the target loader (Hub ids, local folders, aliases), which training and decoding
  both read the target through; :mod:`selfspec.base.adapter`: a base model with a PEFT adapter merged in.

Nothing is imported here: import the module you need.
"""
