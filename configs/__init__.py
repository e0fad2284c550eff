"""The shipped training configs (YAML), installed as package data so a wheel install finds them."""
