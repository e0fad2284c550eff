"""The tuning layer: what measures this machine and sizes draft trees from the measurements.

Verification costs by tree size (:mod:`.costs`) and by batch size (:mod:`.batch_rule`), drafting costs by
depth (:mod:`.draft_costs`), acceptance profiles (:mod:`.calibration`) and the budget chosen from them
(:mod:`.budget`). This package imports the exact core of :mod:`selfspec.decode`; the core never imports it:
what it decides reaches the loop and the drafters as plain arguments.
"""
