"""Integrations with other libraries (each module imports its library itself; importing this
package imports none of them)."""
