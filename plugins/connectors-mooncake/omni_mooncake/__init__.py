"""Mooncake connectors for Omni: ``mooncake-store`` and ``mooncake-te`` (see the README).

Importing this package imports nothing from Mooncake: `omni plugins` and `omni --help` load
`omni_mooncake.plugin` on every run, and the connectors import Mooncake only when built.
"""
