"""Omni's test kit, for the core's tests and for plugins' own (``pip install 'omni-core[testing]'``).

- `omni_core.testing.family_contract`: `FamilyContract`, the suite every model family runs.
- `omni_core.testing.connector_contract`: `ConnectorContract`, the suite every connector runs.
- `omni_core.testing.tiny_lm`: `tiny_lm(directory, arch=...)`, a tiny random causal LM with an
  offline-trained tokenizer, for a family's ``make_tiny`` to build on.
- `omni_core.testing.tokenizer`: byte-level BPE tokenizers trained offline.
- `omni_core.testing.live_server`: `LiveServer`, a real ``omni serve`` process.
- `omni_core.testing.fakes`: stand-in stages for tests about the core's own logic.

Importing this package imports nothing heavy; each module imports torch, transformers ... only
where it needs them.
"""
