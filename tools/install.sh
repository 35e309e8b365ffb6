#!/usr/bin/env bash
# Builds libforksafe.so (optimized) and installs it with its headers, a CMake package, a
# pkg-config file, the shm manager program and the Python package for /usr/bin/python3 (docs/building.md, "The package";
# docs/python.md).
#   bash tools/install.sh [--prefix DIR]        (default /usr/local; as root for system prefixes)
# Installs the Debian packages it needs first (tools/install_deps.sh). Safe to re-run over an
# earlier install: the library of this version and the symlinks are replaced, and the headers and
# the CMake package are installed afresh (files of an older install that no longer exist go).
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=/usr/local
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a directory" >&2; exit 2; }
              prefix="$2"; shift 2 ;;
    --prefix=*) prefix="${1#--prefix=}"; shift ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument '$1' (usage: bash tools/install.sh [--prefix DIR])" >&2
       exit 2 ;;
  esac
done
mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"

bash tools/install_deps.sh

# The version, from forksafe/version.h.
version_field() { sed -n "s/^#define FORKSAFE_VERSION_$1 \([0-9]*\)$/\1/p" version.h; }
major="$(version_field MAJOR)"; minor="$(version_field MINOR)"; patch="$(version_field PATCH)"
if [ -z "$major" ] || [ -z "$minor" ] || [ -z "$patch" ]; then
  echo "install.sh: cannot read FORKSAFE_VERSION_MAJOR/MINOR/PATCH from version.h" >&2
  exit 1
fi
version="$major.$minor.$patch"

tmp_files=()
trap 'rm -f "${tmp_files[@]}"' EXIT
build_log="$(mktemp)"; tmp_files+=("$build_log")
echo "forksafe: building //:libforksafe.so, //python:_forksafe.so and //mp:forksafe-shm-manager $version (optimized)"
build_status=0
bazel build --compilation_mode=opt //:libforksafe.so //python:_forksafe.so \
  //mp:forksafe-shm-manager >"$build_log" 2>&1 || build_status=$?
grep -v "linux-sandbox" "$build_log" || true
bin="$(bazel info --compilation_mode=opt bazel-bin 2>/dev/null)"
built="$bin/libforksafe.so"
built_ext="$bin/python/_forksafe.so"
built_manager="$bin/mp/forksafe-shm-manager"
if [ "$build_status" -ne 0 ] || [ ! -f "$built" ] || [ ! -f "$built_ext" ] ||
   [ ! -f "$built_manager" ]; then
  echo "install.sh: the build of //:libforksafe.so, //python:_forksafe.so or" \
       "//mp:forksafe-shm-manager failed (output above)" >&2
  exit 1
fi

# What the library exports: forksafe's API and two C symbols (tools/forksafe.map).
soname="$(readelf -d "$built" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')"
if [ "$soname" != "libforksafe.so.$major" ]; then
  echo "install.sh: the library's SONAME is '$soname', not libforksafe.so.$major" >&2
  exit 1
fi
exported="$(nm -DC --defined-only "$built" | cut -d' ' -f3-)"
stray="$(grep -vE '^((typeinfo|typeinfo name|vtable|VTT|construction vtable|guard variable|TLS init function|TLS wrapper function) for |(virtual|non-virtual|covariant return) thunk to )?forksafe::|^forksafe_process_instance_v1$|^__cxa_throw$' <<<"$exported" || true)"
if [ -n "$stray" ]; then
  echo "install.sh: libforksafe.so exports symbols outside forksafe's API (tools/forksafe.map):" >&2
  head -20 <<<"$stray" >&2
  exit 1
fi
# Test and benchmark hooks are listed by name under local: in the map; one whose signature changed
# would slip back into the exports unnoticed.
hooks="$(grep -E 'For(Test|Testing|Benchmark)\(' <<<"$exported" || true)"
if [ -n "$hooks" ]; then
  echo "install.sh: libforksafe.so exports test hooks (list them under local: in tools/forksafe.map):" >&2
  head -20 <<<"$hooks" >&2
  exit 1
fi
n_exported="$(wc -l <<<"$exported")"

# The headers: every public header (not under internal/), and the internal ones that a header
# already in the set includes, followed transitively from the #include lines.
declare -A seen=()
queue=(version.h)
for f in runtime/*.h device/*.h mp/*.h; do queue+=("$f"); done
headers=()
while [ ${#queue[@]} -gt 0 ]; do
  f="${queue[0]}"; queue=("${queue[@]:1}")
  [ -n "${seen[$f]:-}" ] && continue
  seen[$f]=1
  if [ ! -f "$f" ]; then
    echo "install.sh: a header includes forksafe/$f, which does not exist" >&2
    exit 1
  fi
  headers+=("$f")
  while read -r inc; do
    queue+=("$inc")
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]forksafe\/\([^">]*\)[">].*/\1/p' "$f")
done

# Every installed header must belong to a library of //:forksafe, or its code would be missing
# from libforksafe.so (a layer's new library must be added to //:forksafe in BUILD.bazel).
in_library="$(bazel query 'kind("source file", deps(//:forksafe))' 2>/dev/null \
                | sed -n 's#^//:\(.*\.h\)$#\1#p; s#^//\([^:][^:]*\):\(.*\.h\)$#\1/\2#p')"
for f in "${headers[@]}"; do
  if ! grep -qxF "$f" <<<"$in_library"; then
    echo "install.sh: $f is a public header, but no library of //:forksafe has it: add its" \
         "library to //:forksafe in BUILD.bazel, so that libforksafe.so holds its code" >&2
    exit 1
  fi
done

# Other libraries' headers that the installed headers include, by top folder: each must be
# provided by a Debian package that tools/install_deps.sh installs, and is declared below to
# CMake (find_dependency) and pkg-config (Requires) where the package ships a config for them.
cmake_deps=""; cmake_links="Threads::Threads"; pc_requires=""; third_party=""
for dir in $(cat "${headers[@]}" \
               | sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]\([^/">]*\)\/[^">]*[">].*/\1/p' \
               | sort -u); do
  case "$dir" in
    forksafe|sys|linux|bits|asm|netinet|arpa) ;;  # forksafe's own, and the C library's
    cereal) cmake_deps+="find_dependency(cereal)"$'\n'; cmake_links+=";cereal::cereal"
            third_party+=" cereal(libcereal-dev)" ;;
    dlpack) cmake_deps+="find_dependency(dlpack)"$'\n'; cmake_links+=";dlpack::dlpack"
            third_party+=" dlpack(libdlpack-dev)" ;;
    tbb|oneapi) cmake_deps+="find_dependency(TBB)"$'\n'; cmake_links+=";TBB::tbb"
                pc_requires+=" tbb"; third_party+=" oneTBB(libtbb-dev)" ;;
    *) echo "install.sh: an installed header includes <$dir/...>: say in tools/install.sh which" \
            "package provides it and how CMake and pkg-config find it" >&2
       exit 1 ;;
  esac
done

libdir="$prefix/lib"
incdir="$prefix/include"
cmakedir="$libdir/cmake/forksafe"
pcdir="$libdir/pkgconfig"
mkdir -p "$libdir" "$pcdir"

# The library: install replaces the file (a new inode), so running programs keep the old one.
install -m 755 "$built" "$libdir/libforksafe.so.$version"
ln -sfn "libforksafe.so.$version" "$libdir/libforksafe.so.$major"
ln -sfn "libforksafe.so.$major" "$libdir/libforksafe.so"
# The file_system strategy's manager, for programs that cannot serve it themselves (Python, a C++
# program without InitMain): the library looks for it in the forksafe/ folder beside itself.
install -m 755 -D "$built_manager" "$libdir/forksafe/forksafe-shm-manager"

rm -rf "$incdir/forksafe"
for f in "${headers[@]}"; do
  install -m 644 -D "$f" "$incdir/forksafe/$f"
done

rm -rf "$cmakedir"
mkdir -p "$cmakedir"
cat > "$cmakedir/forksafeConfig.cmake" <<EOF
# forksafe $version: the imported target forksafe::forksafe (tools/install.sh wrote this file).
# It carries the include directory, -pthread (Threads::Threads), the targets of the libraries
# whose headers forksafe's headers include, and C++17. Relocatable: paths are relative to this
# file.
include(CMakeFindDependencyMacro)
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_dependency(Threads)
${cmake_deps}
get_filename_component(_forksafe_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET forksafe::forksafe)
  add_library(forksafe::forksafe SHARED IMPORTED)
  set_target_properties(forksafe::forksafe PROPERTIES
    IMPORTED_LOCATION "\${_forksafe_prefix}/lib/libforksafe.so.$version"
    IMPORTED_SONAME "libforksafe.so.$major"
    INTERFACE_INCLUDE_DIRECTORIES "\${_forksafe_prefix}/include"
    INTERFACE_LINK_LIBRARIES "$cmake_links"
    INTERFACE_COMPILE_FEATURES "cxx_std_17")
endif()
unset(_forksafe_prefix)
EOF
version_script="$(mktemp)"; tmp_files+=("$version_script")
cat > "$version_script" <<EOF
include(CMakePackageConfigHelpers)
write_basic_package_version_file("$cmakedir/forksafeConfigVersion.cmake"
  VERSION $version COMPATIBILITY SameMajorVersion)
EOF
cmake -P "$version_script"

cat > "$pcdir/forksafe.pc" <<EOF
# forksafe $version (tools/install.sh). The headers of cereal and DLPack, which forksafe's headers
# include, come from Debian's libcereal-dev and libdlpack-dev in /usr/include (no .pc files).
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: forksafe
Description: A fork-safe runtime and a multiprocessing API for C++ ML frameworks
Version: $version
${pc_requires:+Requires:$pc_requires
}Libs: -L\${libdir} -lforksafe -pthread
Cflags: -I\${includedir} -pthread
EOF

# The Python package, for Debian's /usr/bin/python3 (3.11): <prefix>/lib/python3.11/dist-packages
# is on its path for the prefixes /usr/local and /usr; the extension finds libforksafe.so.$major
# through its RUNPATH ($ORIGIN/../../.. is <prefix>/lib).
pydir="$libdir/python3.11/dist-packages/forksafe"
rm -rf "$pydir"
mkdir -p "$pydir"
(cd python/forksafe && find . -name '*.py' -exec install -m 644 -D {} "$pydir/{}" \;)
install -m 755 "$built_ext" "$pydir/_forksafe.so"

# A prefix on the dynamic loader's default path: refresh its cache so libforksafe.so.$major is
# found at once.
if [ "$(id -u)" -eq 0 ] && { [ "$libdir" = /usr/local/lib ] || [ "$libdir" = /usr/lib ]; }; then
  ldconfig
fi

cat <<EOF
forksafe $version installed in $prefix:
  $libdir/libforksafe.so.$version  (SONAME libforksafe.so.$major; $n_exported symbols exported, all forksafe's)
  $libdir/libforksafe.so.$major -> libforksafe.so.$version
  $libdir/libforksafe.so -> libforksafe.so.$major
  $libdir/forksafe/forksafe-shm-manager  (the file_system strategy's manager, found by the library)
  $incdir/forksafe/  (${#headers[@]} headers: the public ones and the internal ones they include)
  $cmakedir/forksafeConfig.cmake, forksafeConfigVersion.cmake  (find_package(forksafe CONFIG); target forksafe::forksafe)
  $pcdir/forksafe.pc  (pkg-config --cflags --libs forksafe)
  $pydir/  (the Python package: /usr/bin/python3 -c 'import forksafe'; for a prefix other than /usr/local and /usr, with PYTHONPATH=$libdir/python3.11/dist-packages)
  other libraries' headers included by forksafe's:${third_party:- none}
EOF
