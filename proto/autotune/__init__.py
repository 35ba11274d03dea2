"""Versioned autotune protocol packages."""
