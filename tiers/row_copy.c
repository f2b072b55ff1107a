/* himamba: copy a batch of byte rows with streaming (non-temporal) stores.
 *
 * Why: a CPU-tier store or load moves thousands of 36-64 KiB rows between scattered cache
 * blocks and host slots. glibc's memcpy writes rows that small through the cache, so every
 * destination line is read before it is written (~1.5x the memory traffic of the copy);
 * it switches to streaming stores only for copies of tens of MB. Streaming stores write
 * whole lines without reading them. Built on first use by tiers/native_copy.py with the
 * system C compiler; without one, the numpy path (tiers/host_copy.py) does the same copies.
 *
 * The caller (Python) checks every address range against its arrays before calling.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HIMAMBA_STREAM 1
#endif

/* Rows shorter than this go through memcpy: the fence and alignment work is not worth it. */
#define STREAM_MIN_BYTES 4096

static void copy_row(char *dst, const char *src, size_t n)
{
#ifdef HIMAMBA_STREAM
    if (n >= STREAM_MIN_BYTES) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t lines = n / 64;
        for (size_t i = 0; i < lines; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)(dst + 0), a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            src += 64;
            dst += 64;
        }
        n -= lines * 64;
    }
#endif
    memcpy(dst, src, n);
}

/* Row i: nbytes[i] bytes from src[i] to dst[i]. Returns the number of rows copied. The fence
 * makes every streamed line visible before the caller reports the batch done. */
uint64_t himamba_copy_rows(const uint64_t *src, const uint64_t *dst, const uint64_t *nbytes,
                           uint64_t rows)
{
    for (uint64_t i = 0; i < rows; i++)
        copy_row((char *)(uintptr_t)dst[i], (const char *)(uintptr_t)src[i], (size_t)nbytes[i]);
#ifdef HIMAMBA_STREAM
    _mm_sfence();
#endif
    return rows;
}
