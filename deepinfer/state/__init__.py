"""One step's plan (forward_batch) and the decode-time cache state it addresses (kv_state).
Layered below layers/ and models/, above kernels/ and formats/."""
