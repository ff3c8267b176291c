"""Hybrid HiSparse KV residency: where each page of each request lives, and what moves under pressure."""
