/* Opening a run of sealed entries (AES-256-GCM) in one call: client/cache/native_gcm.py builds and loads it.
 *
 * Freestanding on purpose: no header and no library is needed to build it (`cc -shared -nostdlib`), so any C
 * compiler builds it, on any glibc. OpenSSL's EVP functions come in as pointers that Python looked up in the
 * system's libcrypto (ctypes), with one cipher context already keyed for AES-256-GCM; this loop only sets each
 * entry's nonce, feeds its associated data, decrypts it where it lies and checks its tag. ctypes releases the
 * GIL around the call.
 */

typedef int (*bl_init_f)(void *ctx, const void *cipher, void *engine, const unsigned char *key,
                         const unsigned char *iv);
typedef int (*bl_update_f)(void *ctx, unsigned char *out, int *outl, const unsigned char *in, int inl);
typedef int (*bl_final_f)(void *ctx, unsigned char *out, int *outl);
typedef int (*bl_ctrl_f)(void *ctx, int type, int arg, void *ptr);

struct bl_evp {
    bl_init_f decrypt_init; /* EVP_DecryptInit_ex */
    bl_update_f decrypt_update; /* EVP_DecryptUpdate */
    bl_final_f decrypt_final; /* EVP_DecryptFinal_ex */
    bl_ctrl_f ctrl; /* EVP_CIPHER_CTX_ctrl */
};

#define BL_GCM_SET_TAG 0x11 /* EVP_CTRL_GCM_SET_TAG (EVP_CTRL_AEAD_SET_TAG) */
#define BL_TAG 16

/* Open rows 0..n-1 of `buf`: row r starts at first + r * stride; its ciphertext is the `text_len` bytes at
 * `header` past the row's start, its tag the 16 bytes after them, its nonce the 12 bytes at nonces + 12 r, and
 * its associated data aad[aad_ends[r-1] .. aad_ends[r]) (aad_ends[-1] = 0). The plaintext replaces the
 * ciphertext; rows before a failed one are open.
 * Returns n when every row opened; r when row r's tag did not match (its bytes then hold unauthenticated
 * output); -2 - r when a call failed on row r before anything was written to it; -1 for arguments out of range. */
long bl_gcm_open_rows(const struct bl_evp *evp, void *ctx, unsigned char *buf, long first, long stride, long n,
                      long header, long text_len, const unsigned char *nonces, const unsigned char *aad,
                      const long *aad_ends)
{
    long r, start = 0;
    int outl, last;
    if (text_len < 0 || text_len > 0x7fffffffL || n < 0 || first < 0 || header < 0 || stride < text_len)
        return -1;
    for (r = 0; r < n; r++) {
        unsigned char *row = buf + first + r * stride + header;
        long aad_len = aad_ends[r] - start;
        if (aad_len < 0 || aad_len > 0x7fffffffL)
            return -2 - r;
        if (evp->decrypt_init(ctx, 0, 0, 0, nonces + 12 * r) != 1)
            return -2 - r;
        if (aad_len > 0 && evp->decrypt_update(ctx, 0, &outl, aad + start, (int)aad_len) != 1)
            return -2 - r;
        if (evp->decrypt_update(ctx, row, &outl, row, (int)text_len) != 1)
            return r;
        if (evp->ctrl(ctx, BL_GCM_SET_TAG, BL_TAG, row + text_len) != 1)
            return r;
        if (evp->decrypt_final(ctx, row + outl, &last) != 1)
            return r;
        start = aad_ends[r];
    }
    return n;
}
