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
#include <immintrin.h>
#define HIMAMBA_STREAM 1
#endif

/* Rows shorter than this go through memcpy: the fence and alignment work is not worth it. */
#define STREAM_MIN_BYTES 4096

#ifdef HIMAMBA_STREAM
/* SSE2 (every x86-64): 16-byte streaming stores, 64 bytes a loop. */
static void stream_sse2(char *dst, const char *src, size_t n)
{
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
    memcpy(dst, src, n - lines * 64);
}

/* AVX2 where the CPU has it (chosen at run time): 32-byte stores, 128 bytes a loop; moved
 * random rows ~10% faster than SSE2 on the machine in docs/BENCHMARKS.md. */
__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t lines = n / 128;
    for (size_t i = 0; i < lines; i++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + 0));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)(dst + 0), a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
        src += 128;
        dst += 128;
    }
    memcpy(dst, src, n - lines * 128);
}
#endif

/* Row i: nbytes[i] bytes from src[i] to dst[i]. Returns the number of rows copied. The fence
 * makes every streamed line visible before the caller reports the batch done. `isa`: 0 picks
 * the best the CPU has, 1 forces SSE2 (tests check both paths), 2 asks for AVX2. */
uint64_t himamba_copy_rows(const uint64_t *src, const uint64_t *dst, const uint64_t *nbytes,
                           uint64_t rows, int isa)
{
#ifdef HIMAMBA_STREAM
    int avx2 = isa != 1 && __builtin_cpu_supports("avx2");
    void (*stream)(char *, const char *, size_t) = avx2 ? stream_avx2 : stream_sse2;
#else
    (void)isa;
#endif
    for (uint64_t i = 0; i < rows; i++) {
        char *d = (char *)(uintptr_t)dst[i];
        const char *s = (const char *)(uintptr_t)src[i];
        size_t n = (size_t)nbytes[i];
#ifdef HIMAMBA_STREAM
        if (n >= STREAM_MIN_BYTES) {
            stream(d, s, n);
            continue;
        }
#endif
        memcpy(d, s, n);
    }
#ifdef HIMAMBA_STREAM
    _mm_sfence();
#endif
    return rows;
}
