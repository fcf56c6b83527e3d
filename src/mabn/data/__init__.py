"""Datasets and Lightning data modules (import the submodules directly; this package stays import-light)."""
