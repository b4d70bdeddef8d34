"""Quality of KV compression: perplexity / KL / top-1 / passkey through the paged cache (`nanokv eval`)."""
