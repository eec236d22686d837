"""Integrations with model libraries. Each submodule imports its library only when it is used."""
