#include "forksafe/runtime/internal/cgroup.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace forksafe::runtime::internal {
namespace {

// More CPUs than any machine has; a quota beyond it is "none" in practice and keeps the rounding
// far from overflow.
constexpr int64_t kMaxQuotaCpus = int64_t{1} << 20;

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    const size_t at = s.find(sep, start);
    out.push_back(
        s.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start));
    if (at == std::string_view::npos) return out;
    start = at + 1;
  }
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) {
    s.remove_suffix(1);
  }
  return s;
}

// The words of `s` separated by blanks.
std::vector<std::string_view> Words(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n')) ++i;
    const size_t start = i;
    while (i < s.size() && s[i] != ' ' && s[i] != '\t' && s[i] != '\n') ++i;
    if (i > start) out.push_back(s.substr(start, i - start));
  }
  return out;
}

bool ParseInt64(std::string_view s, int64_t* out) {
  if (s.empty()) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

// mountinfo escapes blanks, tabs, newlines and backslashes in paths as \ooo.
std::string Unescape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      const std::string_view oct = s.substr(i + 1, 3);
      if (std::all_of(oct.begin(), oct.end(), [](char c) { return c >= '0' && c <= '7'; })) {
        out.push_back(static_cast<char>((oct[0] - '0') * 64 + (oct[1] - '0') * 8 + (oct[2] - '0')));
        i += 3;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

bool Has(const std::vector<std::string>& v, std::string_view x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Whole CPUs for quota/period, rounded up; 0 when the quota is beyond kMaxQuotaCpus.
int RoundUpCpus(int64_t quota, int64_t period) {
  const int64_t whole = quota / period + (quota % period != 0 ? 1 : 0);
  return whole > kMaxQuotaCpus ? 0 : static_cast<int>(whole);
}

}  // namespace

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<CgroupMount> ParseCgroupMounts(std::string_view mountinfo) {
  std::vector<CgroupMount> out;
  for (std::string_view line : Split(mountinfo, '\n')) {
    // "ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS"
    const std::vector<std::string_view> f = Words(line);
    size_t dash = 6;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash + 3 >= f.size()) continue;  // no "- TYPE SOURCE SUPER_OPTIONS"
    const std::string_view type = f[dash + 1];
    if (type != "cgroup2" && type != "cgroup") continue;
    CgroupMount m;
    m.v2 = type == "cgroup2";
    m.root = Unescape(f[3]);
    m.mount_point = Unescape(f[4]);
    if (!m.v2) {
      for (std::string_view opt : Split(f[dash + 3], ',')) m.controllers.emplace_back(opt);
    }
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<CgroupMembership> ParseProcCgroup(std::string_view text) {
  std::vector<CgroupMembership> out;
  for (std::string_view line : Split(text, '\n')) {
    const size_t c1 = line.find(':');
    const size_t c2 = c1 == std::string_view::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string_view::npos) continue;
    CgroupMembership m;
    const std::string_view id = line.substr(0, c1);
    const std::string_view controllers = line.substr(c1 + 1, c2 - c1 - 1);
    m.path = std::string(line.substr(c2 + 1));
    if (m.path.empty() || m.path.front() != '/') continue;
    m.v2 = id == "0" && controllers.empty();
    if (!m.v2) {
      if (controllers.empty()) continue;
      for (std::string_view c : Split(controllers, ',')) m.controllers.emplace_back(c);
    }
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<std::string> CgroupDirChain(const std::string& root, const CgroupMount& mount,
                                        const std::string& path) {
  // The part of `path` below the mount's root.
  std::string rel;
  if (mount.root == "/") {
    rel = path;
  } else if (path == mount.root) {
    rel = "/";
  } else if (path.compare(0, mount.root.size(), mount.root) == 0 &&
             path.size() > mount.root.size() && path[mount.root.size()] == '/') {
    rel = path.substr(mount.root.size());
  } else {
    return {};
  }
  if (rel.find("/..") != std::string::npos) return {};  // outside this cgroup namespace's root
  std::vector<std::string> out;
  while (!rel.empty() && rel != "/") {
    out.push_back(root + mount.mount_point + rel);
    rel.resize(rel.rfind('/'));
  }
  out.push_back(root + mount.mount_point);
  return out;
}

int CpusFromCpuMax(std::string_view text) {
  const std::vector<std::string_view> w = Words(text);
  if (w.empty() || w.size() > 2) return -1;
  int64_t period = 100000;  // the kernel's default when only the quota is given
  if (w.size() == 2 && (!ParseInt64(w[1], &period) || period <= 0)) return -1;
  if (w[0] == "max") return 0;
  int64_t quota = 0;
  if (!ParseInt64(w[0], &quota) || quota <= 0) return -1;
  return RoundUpCpus(quota, period);
}

int CpusFromCfs(std::string_view quota_text, std::string_view period_text) {
  int64_t quota = 0;
  int64_t period = 0;
  if (!ParseInt64(Trim(quota_text), &quota)) return -1;
  if (quota == -1) return 0;
  if (quota <= 0 || !ParseInt64(Trim(period_text), &period) || period <= 0) return -1;
  return RoundUpCpus(quota, period);
}

std::vector<CgroupPlace> LocateCgroups(std::string_view controller, const std::string& root) {
  std::vector<CgroupMount> mounts = ParseCgroupMounts(ReadSmallFile(root + "/proc/self/mountinfo"));
  if (mounts.empty()) {  // no mountinfo to go by: the usual places
    mounts.push_back({true, "/", "/sys/fs/cgroup", {}});
    mounts.push_back(
        {false, "/", "/sys/fs/cgroup/" + std::string(controller), {std::string(controller)}});
  }
  std::vector<CgroupPlace> out;
  for (const CgroupMembership& member :
       ParseProcCgroup(ReadSmallFile(root + "/proc/self/cgroup"))) {
    if (!member.v2 && !Has(member.controllers, controller)) continue;
    for (const CgroupMount& mount : mounts) {
      if (mount.v2 != member.v2 || (!mount.v2 && !Has(mount.controllers, controller))) continue;
      std::vector<std::string> dirs = CgroupDirChain(root, mount, member.path);
      if (dirs.empty()) continue;  // a bind mount of another part of the hierarchy
      out.push_back({mount.v2, root + mount.mount_point, std::move(dirs)});
      break;  // one mount per hierarchy is enough
    }
  }
  return out;
}

CpuQuota ReadCpuQuota(const std::string& root) {
  CpuQuota best;
  const auto consider = [&best, &root](int cpus, const std::string& file) {
    if (cpus > 0 && (best.cpus == 0 || cpus < best.cpus)) {
      best.cpus = cpus;
      best.file = file.substr(root.size());
    }
  };
  for (const CgroupPlace& place : LocateCgroups("cpu", root)) {
    for (const std::string& dir : place.dirs) {
      if (place.v2) {
        const std::string file = dir + "/cpu.max";
        consider(CpusFromCpuMax(ReadSmallFile(file)), file);
      } else {
        const std::string file = dir + "/cpu.cfs_quota_us";
        consider(CpusFromCfs(ReadSmallFile(file), ReadSmallFile(dir + "/cpu.cfs_period_us")), file);
      }
    }
  }
  return best;
}

}  // namespace forksafe::runtime::internal
