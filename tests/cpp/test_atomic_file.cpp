// Files replaced atomically, also by writers of one path on several threads.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "util/atomic_file.h"

namespace roundpipe {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
  }
  return out;
}

TEST(AtomicFile, WritersOfOnePathOnSeveralThreadsEachReplaceItWhole) {
  const std::string dir = ::testing::TempDir() + "/atomic." + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string path = dir + "/file";
  std::vector<std::string> contents;
  for (int t = 0; t < 4; ++t) contents.push_back(std::string(100000 + t, static_cast<char>('a' + t)));
  std::vector<std::thread> writers;
  for (int t = 0; t < 4; ++t) {
    writers.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) write_file_atomically(path, contents[t]);
    });
  }
  for (auto& w : writers) w.join();
  const std::string got = read_all(path);
  bool whole = false;
  for (const auto& c : contents) whole = whole || got == c;
  EXPECT_TRUE(whole) << "the file mixes two writers' bytes (" << got.size() << " bytes)";
  EXPECT_EQ(entries(dir), std::vector<std::string>{"file"}) << "a temporary file was left behind";
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

TEST(AtomicFile, AWriterNeverCommittedLeavesThePreviousFile) {
  const std::string path = ::testing::TempDir() + "/atomic-keep." + std::to_string(::getpid());
  write_file_atomically(path, "before");
  {
    AtomicFileWriter writer(path);
    writer.write("after", 5);
  }  // no commit
  EXPECT_EQ(read_all(path), "before");
  EXPECT_THROW(write_file_atomically("/nonexistent-dir/x", "y"), c10::Error);
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace roundpipe
