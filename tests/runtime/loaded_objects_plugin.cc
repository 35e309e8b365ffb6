// A plugin for loaded_objects_test (runtime/internal/loaded_objects.h), dlopen'ed RTLD_LOCAL:
// built twice, once as usual and once linked at 0x4000000000000000 (-Wl,-Ttext-segment, as a
// prelinked library), which the loader maps elsewhere, so that its load bias wraps around.
extern "C" __attribute__((visibility("default"), noinline)) int loaded_objects_plugin_marker() {
  return 42;
}
