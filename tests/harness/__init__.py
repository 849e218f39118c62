"""Harnesses that are not part of the installed package: the tests import them, and so do the scripts
behind make targets (which put the checkout on sys.path)."""
