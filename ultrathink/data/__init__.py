"""Corpus loading, validation and packing into token files."""
