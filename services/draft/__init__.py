"""Draft service: proposes draft tokens by exact-repeat (n-gram) matching."""
