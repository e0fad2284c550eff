"""Builders shared by the test modules: tiny targets, random and oracle heads, scripted drafters,
tokenizers, conversations, exact-enumeration and statistics helpers, a fake Hub server.

A test module imports from here (and uses the fixtures of ``tests/conftest.py``); it never imports
another test module (``tests/test_layers_tests.py`` checks this).
"""
