"""Generated from ``proto/mixrl/v1/*.proto`` by ``python -m mixrl_wire.codegen``; do not edit."""
