"""selfspec as an engine of the bench: its own decoder in this process (:mod:`selfspec.engines.selfspec.engine`)."""
