"""Versioned wire protocols between the parts; parts talk only through these modules."""
